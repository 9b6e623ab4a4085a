"""Extent ciphers kept for loads live exactly as long as the clear data keys they come from.

A load's plan derives every extent's cipher (HKDF of the data key and the extent's salt, then an
AEAD object); the keyring keeps them for the next load of the same extents. A kept cipher holds
a subkey of a tenant's data key, so deleting the tenant, retiring a key version or another
node's key change (``clear``) must drop it with the clear key itself.
"""

from __future__ import annotations

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.components.keyring import Keyring
from tenantkv.errors import CacheMissError

from .helpers import MLA_SMALL, random_layers, random_tokens


def _store_and_load(kv: TenantKV, tenant: str, seed: int) -> tuple[bytes, list[int]]:
    """A tenant with one stored 128-token prefix, loaded once; its id and tokens."""
    kv.create_tenant(tenant)
    ns = kv.namespace(tenant, model="m", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=seed)
    ns.store(tokens, random_layers(MLA_SMALL, 128, seed=seed))
    with ns.load(tokens) as stream:
        assert sum(1 for _ in stream) == MLA_SMALL.num_layers
    return ns.identity.tenant_id, tokens


def _keyring(kv: TenantKV) -> Keyring:
    return kv.context.keys


def test_a_second_load_reuses_the_extent_cipher(kv: TenantKV) -> None:
    tenant_id, tokens = _store_and_load(kv, "acme", seed=1)
    keys = _keyring(kv)
    assert keys.cached_extent_ciphers(tenant_id) == 1
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    with kv.context.index.read_connection() as connection:
        first = ns._plan(connection, ns._keys(tokens)).extents[0].cipher
        again = ns._plan(connection, ns._keys(tokens)).extents[0].cipher
    assert first is again
    assert keys.cached_extent_ciphers(tenant_id) == 1


def test_deleting_a_tenant_drops_its_extent_ciphers_only(kv: TenantKV) -> None:
    acme, _ = _store_and_load(kv, "acme", seed=1)
    other, other_tokens = _store_and_load(kv, "other", seed=2)
    keys = _keyring(kv)
    assert keys.cached_extent_ciphers(acme) == 1  # the positive control
    kv.delete_tenant("acme")
    assert keys.cached_extent_ciphers(acme) == 0
    assert keys.cached_extent_ciphers(other) == 1
    ns = kv.namespace("other", model="m", layout=MLA_SMALL)
    assert ns.lookup(other_tokens) == len(other_tokens)


def test_retiring_a_key_version_drops_the_ciphers_sealed_under_it(kv: TenantKV) -> None:
    acme, tokens = _store_and_load(kv, "acme", seed=1)
    keys = _keyring(kv)
    assert keys.cached_extent_ciphers(acme) == 1
    kv.rotate_keys("acme")
    kv.retire_keys("acme")  # re-seals the extent under version 2, then retires version 1
    assert keys.cached_extent_ciphers(acme) == 0
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    with ns.load(tokens) as stream:  # the re-sealed extent loads, under a new cipher
        assert sum(1 for _ in stream) == MLA_SMALL.num_layers
    assert keys.cached_extent_ciphers(acme) == 1


def test_clear_drops_every_extent_cipher(kv: TenantKV) -> None:
    acme, _ = _store_and_load(kv, "acme", seed=1)
    keys = _keyring(kv)
    assert keys.cached_extent_ciphers(acme) == 1
    keys.clear()
    assert keys.cached_extent_ciphers(acme) == 0


def test_the_kept_ciphers_are_bounded(kv: TenantKV, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenantkv.components.keyring, "EXTENT_CIPHERS_KEPT", 2)
    ids = [_store_and_load(kv, f"t{i}", seed=i)[0] for i in range(3)]
    keys = _keyring(kv)
    assert [keys.cached_extent_ciphers(t) for t in ids] == [0, 1, 1]  # least recent dropped


def test_a_deleted_tenants_prefix_is_a_miss_not_a_kept_cipher(kv: TenantKV) -> None:
    _store_and_load(kv, "acme", seed=1)
    kv.delete_tenant("acme")
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(128, seed=1)
    assert ns.lookup(tokens) == 0
    with pytest.raises(CacheMissError):
        ns.load(tokens)
