"""Token-id lists packed in C (``tenantkv/_token_ids.c``) against the array.array reference.

Every lookup, store and load of a prompt given as a list goes through the C packer where the
install built it. It must accept exactly what the Python path accepts, give the same ids, and
refuse the rest with the same errors (the bad-input tests check the messages through the API).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv import tokens
from tenantkv.errors import InvalidRequestError
from tenantkv.tokens import MAX_TOKEN_ID, as_token_array

packer = tokens._pack


def test_the_c_packer_is_built_in_this_install() -> None:
    """setup.py builds it wherever a C compiler is at hand, as on every machine this project
    runs its tests on; were it missing, list prompts would silently pack 2.4x slower."""
    assert packer is not None, "tenantkv._token_ids was not built (see setup.py)"


def outcome(function: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", function(value).tolist()
    except InvalidRequestError as err:
        return "error", str(err)


ids = st.integers(0, MAX_TOKEN_ID)
elements = st.one_of(
    ids,
    ids.map(np.int64),
    st.integers(0, 2**31 - 1).map(np.uint32),
    st.integers(-(2**70), -1),
    st.integers(MAX_TOKEN_ID + 1, 2**70),
    st.booleans(),
    st.floats(allow_nan=False),
    st.just("7"),
    st.lists(ids, max_size=2),
)


@pytest.mark.skipif(packer is None, reason="tenantkv._token_ids not built")
@settings(max_examples=300, deadline=None)
@given(
    values=st.one_of(st.lists(ids, max_size=500), st.lists(elements, max_size=20)),
    as_tuple=st.booleans(),
)
def test_c_packer_agrees_with_array_array(values: list[Any], as_tuple: bool) -> None:
    given_tokens = tuple(values) if as_tuple else values
    c = outcome(tokens._list_as_token_array, given_tokens)
    python = outcome(tokens._list_as_token_array_python, given_tokens)
    if len({badness(value) for value in values} - {None}) <= 1:
        assert c == python
    else:  # which of two faults is named first may differ (C stops at the first element)
        assert c[0] == python[0] == "error"


def badness(value: Any) -> str | None:
    """Which refusal an element earns: none for an id."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | np.integer):
        return None if 0 <= int(value) <= MAX_TOKEN_ID else "range"
    return "type"


@pytest.mark.skipif(packer is None, reason="tenantkv._token_ids not built")
def test_c_packer_gives_a_writable_uint32_array_of_every_id() -> None:
    values = [0, 1, 2**16, MAX_TOKEN_ID, 123_456] * 20
    array = as_token_array(values)
    assert array.dtype == np.uint32 and array.flags.writeable and array.flags.c_contiguous
    assert array.tolist() == values


class ShrinksTheList:
    """An id whose ``__index__`` empties the list being packed."""

    def __init__(self, victim: list[Any]) -> None:
        self.victim = victim

    def __index__(self) -> int:
        self.victim.clear()
        return 5


@pytest.mark.skipif(packer is None, reason="tenantkv._token_ids not built")
def test_c_packer_survives_a_list_changed_under_it() -> None:
    """Python code run by ``__index__`` can change the list: the packer notices, and neither
    reads past its end nor crashes."""
    victim: list[Any] = [1, 2, 3]
    victim.insert(1, ShrinksTheList(victim))
    victim.extend(range(100))
    with pytest.raises(RuntimeError, match="changed size"):
        as_token_array(victim)
    # positive control: the same kind of element, leaving its list alone, packs
    assert as_token_array([1, np.int64(5), 3]).tolist() == [1, 5, 3]
