"""check_disjoint against a simple model: the set of bytes each view touches.

Loads refuse ``out=`` buffers that share a byte, before anything is read. The check compares
each tensor's span (first to last byte it may touch), which is exact for contiguous tensors
(the fast path) and conservative for strided ones; the model enumerates every element's bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv.errors import InvalidRequestError
from tenantkv.tensor_checks import check_disjoint

BASE_ELEMENTS = 64


def _bytes_of(tensor: torch.Tensor) -> set[int]:
    """Every byte address ``tensor`` covers, by walking all its elements' offsets."""
    size = tensor.element_size()
    start = tensor.data_ptr()
    offsets = [0]
    for n, stride in zip(tensor.shape, tensor.stride(), strict=True):
        offsets = [o + i * stride for o in offsets for i in range(n)]
    return {start + o * size + b for o in offsets for b in range(size)} if tensor.numel() else set()


@st.composite
def _views(draw: st.DrawFn) -> tuple[list[torch.Tensor], bool]:
    """2-5 views of one or two base buffers: slices (some strided, some reshaped)."""
    bases = [torch.zeros(BASE_ELEMENTS, dtype=torch.int16) for _ in range(2)]
    views: list[torch.Tensor] = []
    contiguous = True
    for _ in range(draw(st.integers(2, 5))):
        base = bases[draw(st.integers(0, 1))]
        start = draw(st.integers(0, BASE_ELEMENTS - 1))
        stop = draw(st.integers(start, BASE_ELEMENTS))
        step = draw(st.sampled_from([1, 1, 2, 3]))
        view = base[start:stop:step]
        if step == 1 and view.numel() % 2 == 0 and view.numel() and draw(st.booleans()):
            view = view.view(-1, 2)  # a 2-D contiguous view
        contiguous = contiguous and view.is_contiguous()
        views.append(view)
    return views, contiguous


@settings(max_examples=300, deadline=None)
@given(_views())
def test_check_disjoint_refuses_every_shared_byte(case: tuple[list[torch.Tensor], bool]) -> None:
    views, all_contiguous = case
    named = [(f"out[{i}]", view) for i, view in enumerate(views)]
    covered = [_bytes_of(view) for view in views]
    shared = any(
        covered[i] & covered[j] for i in range(len(views)) for j in range(i + 1, len(views))
    )
    try:
        check_disjoint(named)
        refused = False
    except InvalidRequestError as err:
        refused = True
        assert "shares memory with" in str(err)
    if shared:
        assert refused, "views sharing a byte were accepted"
    elif all_contiguous:
        assert not refused, "contiguous views that share no byte were refused"


def test_adjacent_rows_of_one_pool_are_accepted() -> None:
    """The positive control of the refusals: distinct row ranges of one buffer pass."""
    pool = torch.zeros(8, 576, dtype=torch.bfloat16)
    check_disjoint([("a", pool[0:4]), ("b", pool[4:8])])
    with pytest.raises(InvalidRequestError, match="b shares memory with a"):
        check_disjoint([("a", pool[0:5]), ("b", pool[4:8])])
