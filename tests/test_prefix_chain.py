"""The C chain of prefix keys (``tenantkv/_prefix_chain.c``) against the hashlib reference.

Every lookup, store and load keys its blocks through :func:`tenantkv.prefix.block_keys`, which
runs the C chain where the install built it. A key that differed by one bit from the hashlib
loop's would orphan every cache on disk, so the two are compared over random keys, seeds,
personalisations, block sizes and prompts, including the edges of BLAKE2b's 128-byte blocks.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv import prefix
from tenantkv.prefix import BLOCK_TOKENS_STEP, MAX_BLOCK_TOKENS, block_keys, block_keys_python

chain = prefix.c_chain


def test_the_c_chain_is_built_in_this_install() -> None:
    """setup.py builds it wherever a C compiler is at hand, as on every machine this project
    runs its tests on; were it missing, lookups would silently take 1.6x as long."""
    assert chain is not None, "tenantkv._prefix_chain was not built (see setup.py)"


needs_chain = pytest.mark.skipif(chain is None, reason="tenantkv._prefix_chain not built")

block_sizes = st.integers(1, MAX_BLOCK_TOKENS // BLOCK_TOKENS_STEP).map(
    lambda n: n * BLOCK_TOKENS_STEP
)


@needs_chain
@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=32, max_size=32),
    seed=st.binary(min_size=32, max_size=32),
    block_tokens=block_sizes,
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=3000),
)
def test_c_chain_gives_the_hashlib_keys(
    key: bytes, seed: bytes, block_tokens: int, tokens: list[int]
) -> None:
    array = np.array(tokens, dtype=np.uint32)
    expected = block_keys_python(key, prefix.Fingerprint(seed), array, block_tokens)
    assert len(expected) == len(tokens) // block_tokens
    assert block_keys(key, prefix.Fingerprint(seed), array, block_tokens) == expected


@needs_chain
@settings(max_examples=100, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=64),
    person=st.binary(max_size=16),
    seed=st.binary(min_size=32, max_size=32),
    block_bytes=st.integers(1, 600),
    data=st.binary(max_size=2400),
)
def test_c_chain_is_keyed_blake2b_for_any_key_person_and_block_length(
    key: bytes, person: bytes, seed: bytes, block_bytes: int, data: bytes
) -> None:
    """Key lengths other than 32, short personalisations and message lengths on every side of
    a 128-byte boundary (32 + block_bytes from 33 to 632) against hashlib itself."""
    expected = []
    previous = seed
    for start in range(0, len(data) // block_bytes * block_bytes, block_bytes):
        digest = hashlib.blake2b(previous, key=key, digest_size=32, person=person)
        digest.update(data[start : start + block_bytes])
        previous = digest.digest()
        expected.append(previous)
    assert chain is not None
    assert chain(key, person, seed, data, block_bytes) == expected


@needs_chain
@pytest.mark.parametrize(
    ("key", "person", "seed", "block_bytes"),
    [
        (b"", b"p", bytes(32), 256),  # no key
        (bytes(65), b"p", bytes(32), 256),  # key too long for BLAKE2b
        (bytes(32), bytes(17), bytes(32), 256),  # personalisation too long
        (bytes(32), b"p", bytes(31), 256),  # seed not a 32-byte key
        (bytes(32), b"p", bytes(32), 0),  # no block length
    ],
)
def test_c_chain_refuses_what_blake2b_or_the_chain_cannot_take(
    key: bytes, person: bytes, seed: bytes, block_bytes: int
) -> None:
    assert chain is not None
    with pytest.raises(ValueError, match="key must be"):
        chain(key, person, seed, bytes(1024), block_bytes)
    # positive control: the same call with the bad argument put right answers
    assert len(chain(bytes(32), b"p", bytes(32), bytes(1024), 256)) == 4
