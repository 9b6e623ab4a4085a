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
    if tensor.is_meta:
        raise InvalidRequestError(f"{what} is on the meta device and holds no data")
    return tensor


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, end byte) of the memory ``tensor`` may touch, on its device."""
    if tensor.numel() == 0:
        return (0, 0)
    start = tensor.data_ptr()
    if tensor.is_contiguous():  # the common case (every out= buffer), without the stride walk
        return start, start + tensor.nbytes
    # The farthest element reachable through the strides (negative strides do not exist).
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * tensor.element_size()


def check_disjoint(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors of which any two share a byte (views of one buffer that overlap).

    Views of one buffer that do not overlap (distinct row ranges of one pool) are accepted.
    Runs on every ``out=`` load (61 buffers and more), so it walks each device's spans once in
    address order.
    """
    by_device: dict[torch.device, list[tuple[int, int, str]]] = {}
    for what, tensor in named:
        start, end = _byte_span(tensor)
        if end > start:
            by_device.setdefault(tensor.device, []).append((start, end, what))
    for spans in by_device.values():
        spans.sort()
        reach, whose = -1, ""  # the farthest end so far, and the span it belongs to
        for start, end, what in spans:
            if start < reach:
                raise InvalidRequestError(f"{what} shares memory with {whose}")
            if end > reach:
                reach, whose = end, what
