"""A running load stops when its tenant is deleted (or the key version it reads is retired).

Deletion makes the tenant's data unreadable at once; a layer-wise load that started before it
must not go on handing over layers. On the deleting node the next layer raises
LoadRevokedError; on another node, once its key-epoch watcher has seen the change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tenantkv
from tenantkv import LoadError, LoadRevokedError, Namespace, TenantKV
from tenantkv.components.key_guard import KeyGuard
from tenantkv.index import tenants as tenant_rows
from tests.indexes import Index

from .helpers import MLA_SMALL, random_layers, random_tokens

TOKENS = random_tokens(128, seed=5)
LAYERS = random_layers(MLA_SMALL, 128, seed=5)


def _namespace(kv: TenantKV, tenant: str) -> Namespace:
    if tenant not in {info.name for info in kv.list_tenants()}:
        kv.create_tenant(tenant)
    return kv.namespace(tenant, model="revoke", layout=MLA_SMALL)


@pytest.fixture
def node_a(cache_root: Path) -> Iterator[TenantKV]:
    with tenantkv.open(cache_root, durable=False) as kv:
        for tenant in ("acme", "other"):
            assert _namespace(kv, tenant).store(TOKENS, LAYERS) == 128
        yield kv


def _same(got: tenantkv.Layer, want: tenantkv.Layer) -> bool:
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    return torch.equal(got, want)


def test_without_deletion_every_layer_arrives(node_a: TenantKV) -> None:
    """Positive control of the tests below: the same steps, minus the deletion."""
    with _namespace(node_a, "acme").load(TOKENS) as stream:
        layers = iter(stream)
        assert next(layers)[0] == 0
        node_a.rotate_keys("other")  # a key change of someone else moves the key epoch
        rest = list(layers)
    assert [index for index, _layer in rest] == [1, 2]
    assert all(_same(layer, LAYERS[index]) for index, layer in rest)


def test_deleting_the_tenant_ends_its_running_load_before_the_next_layer(
    node_a: TenantKV,
) -> None:
    acme = _namespace(node_a, "acme").load(TOKENS)
    other = _namespace(node_a, "other").load(TOKENS)
    with acme, other:
        layers = iter(acme)
        index, first = next(layers)
        assert index == 0 and _same(first, LAYERS[0])
        node_a.delete_tenant("acme")
        with pytest.raises(LoadRevokedError) as caught:
            next(layers)
        assert isinstance(caught.value, LoadError)
        assert caught.value.delivered_layers == 1
        with pytest.raises(LoadRevokedError):  # and it stays ended
            acme.wait_for_layer(2)
        assert acme.closed
        # Another tenant's load, running at the same time, is not affected.
        assert [i for i, layer in other if _same(layer, LAYERS[i])] == [0, 1, 2]


def test_deletion_on_another_node_ends_the_load_once_that_node_sees_the_key_epoch(
    node_a: TenantKV, cache_root: Path
) -> None:
    node_b = tenantkv.open(cache_root, durable=False)
    with node_b, _namespace(node_b, "acme").load(TOKENS) as stream:
        assert _same(stream.wait_for_layer(0), LAYERS[0])
        assert node_b.context.key_epoch.check() is False  # nothing changed yet ...
        assert _same(stream.wait_for_layer(1), LAYERS[1])  # ... so layers keep coming
        node_a.delete_tenant("acme")
        # What node B's coordination thread does every couple of seconds, done now.
        node_b.context.key_epoch.check()
        with pytest.raises(LoadRevokedError) as caught:
            stream.wait_for_layer(2)
        assert caught.value.delivered_layers == 2


def test_retiring_the_version_a_load_reads_with_ends_it(node_a: TenantKV, index: Index) -> None:
    """The guard of a load sealed under version 1 says no once version 1 is retired, and yes
    while it exists (positive control)."""
    ctx = node_a.context
    node_a.create_tenant("fresh")
    with ctx.index.read() as session:
        tenant_id = tenant_rows.id_of(session, "fresh")
    assert tenant_id is not None
    guard = KeyGuard(
        ctx.index, lambda: ctx.keys.revocations, tenant_id, {1}, seen=ctx.keys.revocations
    )
    assert guard.keys_exist()
    node_a.rotate_keys("fresh")
    assert guard.keys_exist()  # version 1 still exists after a rotation
    assert node_a.retire_keys("fresh")["retired_versions"] == [1]
    assert not guard.keys_exist()
