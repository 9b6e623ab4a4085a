"""Checks every tensor a caller hands in passes before tenantkv touches its data.

Tensors without ordinary memory behind them (the ``meta`` device, sparse and other non-strided
layouts, nested tensors) would otherwise fail deep inside a copy or a view with PyTorch's own
``NotImplementedError``/``RuntimeError``, after some work was done; and ``out=`` buffers that
share bytes with each other (or with an input) would have one layer's rows overwrite another's.
Both are the caller's mistake, so both are an :class:`InvalidRequestError` raised before
anything is read, written or stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InvalidRequestError


def check_dense(what: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it is a dense (strided) tensor with real data, else InvalidRequestError."""
    if tensor.is_nested:
        raise InvalidRequestError(f"{what} is a nested tensor; pass a dense (strided) tensor")
    if tensor.layout != torch.strided:
        raise InvalidRequestError(
            f"{what} has layout {tensor.layout}; pass a dense (strided) tensor"
        )
    if tensor.device.type == "meta":
        raise InvalidRequestError(f"{what} is on the meta device and holds no data")
    return tensor


def _byte_span(tensor: torch.Tensor) -> tuple[str, int, int]:
    """(device key, first byte, end byte) of the memory ``tensor`` may touch."""
    if tensor.numel() == 0:
        return ("", 0, 0)
    size = tensor.element_size()
    start = tensor.data_ptr()
    # The farthest element reachable through the strides (negative strides do not exist).
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return str(tensor.device), start, start + (last + 1) * size


def check_disjoint(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors of which any two share a byte (views of one buffer that overlap).

    Views of one buffer that do not overlap (distinct row ranges of one pool) are accepted.
    """
    spans = sorted(
        (span, what) for what, tensor in named if (span := _byte_span(tensor))[2] > span[1]
    )
    reach: tuple[str, int, str] | None = None  # (device, farthest end so far, whose)
    for (device, start, end), what in spans:
        if reach is not None and reach[0] == device and start < reach[1]:
            raise InvalidRequestError(f"{what} shares memory with {reach[2]}")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, what)
