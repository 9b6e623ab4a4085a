"""Validation of token sequences: 1-D sequences of integer ids in [0, 2**32)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import InvalidRequestError

TokenArray = npt.NDArray[np.uint32]
MAX_TOKEN_ID = 2**32 - 1


def as_token_array(tokens: Any) -> TokenArray:
    """Return ``tokens`` as a contiguous uint32 array, or raise InvalidRequestError.

    Accepts a list/tuple of ints, a 1-D integer torch tensor or a 1-D integer numpy array. Booleans,
    floats, nested sequences and ids outside [0, 2**32) are refused.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidRequestError(f"tokens must be integers, got a tensor of {tokens.dtype}")
        array: np.ndarray[Any, Any] = tokens.detach().to("cpu").numpy()
    elif isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, list | tuple):
        # One pass in C over the element types (a per-element isinstance loop costs ~2 ms for
        # 8K tokens, on the path to a load's first layer).
        kinds = set(map(type, tokens))
        if any(kind is bool or not issubclass(kind, int | np.integer) for kind in kinds):
            raise InvalidRequestError("tokens must be a flat sequence of integer ids")
        try:
            array = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise InvalidRequestError(f"token ids must lie in [0, {MAX_TOKEN_ID}]") from None
    else:
        raise InvalidRequestError(
            f"tokens must be a list of ints or a 1-D integer tensor, got {type(tokens).__name__}"
        )
    if array.ndim != 1:
        raise InvalidRequestError(f"tokens must be 1-D, got shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidRequestError(f"tokens must be integers, got {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        raise InvalidRequestError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(array, dtype=np.uint32)
