"""Validation of token sequences: 1-D sequences of integer ids in [0, 2**32)."""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import InvalidRequestError
from .tensor_checks import check_dense

TokenArray = npt.NDArray[np.uint32]
MAX_TOKEN_ID = 2**32 - 1
PackFunction = Callable[[list[Any] | tuple[Any, ...]], "bytearray | array.array[int]"]


def _built_packer() -> PackFunction | None:
    """``tenantkv/_token_ids.c``'s packer, where the install built it (setup.py)."""
    try:
        from ._token_ids import pack
    except ImportError:  # pragma: no cover - only an install without a C compiler
        return None
    return pack


_pack = _built_packer()
# The array module's 32-bit unsigned type code (``I`` on every platform CPython supports).
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)


def as_token_array(tokens: Any) -> TokenArray:
    """Return ``tokens`` as a contiguous uint32 array, or raise InvalidRequestError.

    Accepts a list/tuple of ints, a 1-D integer torch tensor or a 1-D integer numpy array. Booleans,
    floats, nested sequences and ids outside [0, 2**32) are refused.
    """
    if isinstance(tokens, torch.Tensor):
        check_dense("tokens", tokens)
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidRequestError(f"tokens must be integers, got a tensor of {tokens.dtype}")
        values: np.ndarray[Any, Any] = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ndarray):
        values = tokens
    elif isinstance(tokens, list | tuple):
        return _list_as_token_array(tokens)
    else:
        raise InvalidRequestError(
            f"tokens must be a list of ints or a 1-D integer tensor, got {type(tokens).__name__}"
        )
    if values.ndim != 1:
        raise InvalidRequestError(f"tokens must be 1-D, got shape {list(values.shape)}")
    if not np.issubdtype(values.dtype, np.integer):
        raise InvalidRequestError(f"tokens must be integers, got {values.dtype}")
    if values.size and (int(values.min()) < 0 or int(values.max()) > MAX_TOKEN_ID):
        raise InvalidRequestError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(values, dtype=np.uint32)


def _list_as_token_array(tokens: list[Any] | tuple[Any, ...]) -> TokenArray:
    """A list or tuple of ids, packed and range-checked in one pass in C: by
    ``tenantkv/_token_ids.c`` where the install built it (0.4x the time of ``array.array`` for
    a 128K-token list), else by :func:`_pack_with_array`."""
    return _packed(_pack or _pack_with_array, tokens)


def _list_as_token_array_python(tokens: list[Any] | tuple[Any, ...]) -> TokenArray:
    """:func:`_list_as_token_array` without the C packer: the same answers and errors."""
    return _packed(_pack_with_array, tokens)


def _packed(pack: PackFunction, tokens: list[Any] | tuple[Any, ...]) -> TokenArray:
    """``pack(tokens)`` as a uint32 array; the packers' errors as InvalidRequestError."""
    try:
        packed = pack(tokens)
    except OverflowError:
        raise InvalidRequestError(f"token ids must lie in [0, {MAX_TOKEN_ID}]") from None
    except ValueError:  # a boolean
        raise InvalidRequestError(
            "tokens must be a flat sequence of integer ids, not booleans"
        ) from None
    except TypeError:
        raise InvalidRequestError("tokens must be a flat sequence of integer ids") from None
    result: TokenArray = np.frombuffer(packed, dtype=np.uint32)
    return result


def _pack_with_array(tokens: list[Any] | tuple[Any, ...]) -> array.array[int]:
    """The C packer's rules with ``array.array``: OverflowError for ids outside [0, 2**32),
    TypeError for floats, strings and nested sequences, ValueError for booleans.

    ``array.array`` takes booleans as 0 and 1, so only the elements that are 0 or 1 have their
    type checked: a per-element check of every type is measurable on the path to a load's
    first layer (docs/perf.md).
    """
    packed = array.array(_UINT32_CODE, tokens)
    values = np.frombuffer(packed, dtype=np.uint32)
    if any(type(tokens[index]) is bool for index in np.flatnonzero(values <= 1).tolist()):
        raise ValueError("booleans are not token ids")
    return packed
