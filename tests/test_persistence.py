"""The cache survives reopening, and concurrent stores of one prefix leave one consistent entry."""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.crypto import KeyEncryptionKey, MasterKeyError
from tenantkv.index.schema import Block, Extent
from tests.helpers import MHA_SMALL, MLA_SMALL, layers_equal, load_all, random_layers, random_tokens


def test_reopen_after_close_keeps_the_cache(cache_root: Path) -> None:
    tokens = random_tokens(200, seed=3)
    layers = random_layers(MHA_SMALL, 200)
    with tenantkv.open(cache_root) as kv:
        kv.create_tenant("acme")
        assert kv.namespace("acme", model="m", layout=MHA_SMALL).store(tokens, layers) == 192
    with tenantkv.open(cache_root) as kv:
        assert [t.name for t in kv.list_tenants()] == ["acme"]
        ns = kv.namespace("acme", model="m", layout=MHA_SMALL)
        assert ns.lookup(tokens) == 192
        for got, want in zip(load_all(ns, tokens[:192]), layers, strict=True):
            assert layers_equal(got, (want[0][:192], want[1][:192]))  # type: ignore[index]


def test_reopen_with_another_master_key_is_refused(cache_root: Path) -> None:
    tokens = random_tokens(64)
    with tenantkv.open(cache_root) as kv:
        kv.create_tenant("acme")
        kv.namespace("acme", model="m", layout=MLA_SMALL).store(
            tokens, random_layers(MLA_SMALL, 64)
        )
    key = (cache_root / "master.key").read_bytes()
    (cache_root / "master.key").unlink()
    with pytest.raises(MasterKeyError, match="does not exist"):
        tenantkv.open(cache_root)  # a key file made now could never open this index
    assert not (cache_root / "master.key").exists()  # and the failed open left none behind
    (cache_root / "master.key").write_text(secrets.token_hex(32) + "\n")
    (cache_root / "master.key").chmod(0o600)
    with pytest.raises(MasterKeyError, match="does not open this cache"):
        tenantkv.open(cache_root)  # another key
    (cache_root / "master.key").unlink()
    (cache_root / "master.key").write_bytes(key)
    (cache_root / "master.key").chmod(0o600)
    with tenantkv.open(cache_root) as kv:  # positive control: the right key opens it again
        assert kv.namespace("acme", model="m", layout=MLA_SMALL).lookup(tokens) == 64


def test_two_threads_storing_the_same_prefix_leave_one_entry(kv: TenantKV) -> None:
    kv.create_tenant("acme")
    tokens = random_tokens(512, seed=7)
    layers = random_layers(MLA_SMALL, 512)
    results: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def store() -> None:
        try:
            ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
            barrier.wait()
            results.append(ns.store(tokens, layers))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=store) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sum(results) == 512  # every block was stored once, by one of the two
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    assert sorted(ns.cached_blocks()) == list(range(8))
    with kv.context.index.read() as session:
        extent_ids = {row for row in session.scalars(session.query(Extent.id).statement)}
        referenced = {row for row in session.scalars(session.query(Block.extent_id).statement)}
    assert extent_ids == referenced, "an extent row without blocks was left behind"
    assert set(kv.context.blocks.list()) == extent_ids, "an unreferenced extent file was left"
    for got, want in zip(load_all(ns, tokens), layers, strict=True):
        assert layers_equal(got, want)


def test_many_threads_store_and_load_different_tenants(kv: TenantKV) -> None:
    names = [f"t{i}" for i in range(4)]
    for name in names:
        kv.create_tenant(name)
    data = {
        name: (random_tokens(192, seed=i), random_layers(MLA_SMALL, 192, seed=i))
        for i, name in enumerate(names)
    }
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            ns = kv.namespace(name, model="m", layout=MLA_SMALL)
            tokens, layers = data[name]
            for _ in range(3):
                ns.store(tokens, layers)
                for got, want in zip(load_all(ns, tokens), layers, strict=True):
                    assert layers_equal(got, want)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert kv.info()["blocks"] == 4 * 3


def test_nodes_opening_a_new_index_at_once_all_open_it(cache_root: Path) -> None:
    """Several nodes start together on one new index: one creates the tables and settings, the
    others find them (no 'already exists' or duplicate-key failures), and all serve one cache."""
    key = KeyEncryptionKey(secrets.token_bytes(32))
    count = 4
    barrier = threading.Barrier(count)
    opened: list[TenantKV] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait()
            opened.append(tenantkv.open(cache_root, durable=False, master_key=key))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=start) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors, errors
        opened[0].create_tenant("acme")
        assert all([t.name for t in node.list_tenants()] == ["acme"] for node in opened)
        keys = set()
        for node in opened:
            with node.context.index.write() as session:
                keys.add(node.context.audit.public_key_pem(session))
        assert len(keys) == 1  # one audit signing key for the whole index
    finally:
        for node in opened:
            node.close()


def test_stores_loads_retention_changes_and_gc_of_one_tenant_run_side_by_side(
    cache_root: Path,
) -> None:
    """Threads load (recording use), store, change retention and collect expired extents of one
    tenant at once; none fails. On PostgreSQL these transactions run side by side and lock the
    same extent rows: they must queue, not deadlock."""
    now = [1_800_000_000.0]
    with tenantkv.open(cache_root, durable=False, clock=lambda: now[0]) as kv:
        _run_side_by_side(kv, now)


def _run_side_by_side(kv: TenantKV, now: list[float]) -> None:
    kv.create_tenant("acme", quota_bytes=2**30, retention={"agent": "1h", "chat": "30d"})
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    kept = [random_tokens(128, seed=i) for i in range(4)]
    for tokens in kept:  # loaded throughout; never expire or evicted
        ns.store(tokens, random_layers(MLA_SMALL, 128), kind="chat")
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = dict.fromkeys(["load", "store", "update", "gc"], 0)

    def repeat(name: str, action: Callable[[int], object]) -> None:
        i = 0
        try:
            while not stop.is_set():
                action(i)
                counts[name] += 1
                i += 1
        except BaseException as err:
            errors.append(err)
            stop.set()

    def load(i: int) -> None:
        load_all(ns, kept[i % len(kept)])

    seeds = itertools.count(1000)

    def store(i: int) -> None:
        tokens = random_tokens(64, seed=next(seeds))  # a new prefix each time
        ns.store(tokens, random_layers(MLA_SMALL, 64), kind="agent")

    def update(i: int) -> None:
        kv.update_tenant("acme", retention={"agent": f"{1 + i % 2}h"})

    def collect(i: int) -> None:
        now[0] += 600
        kv.gc(orphan_grace=10**9)

    actions = {"load": load, "store": store, "update": update, "gc": collect}
    threads = [
        threading.Thread(target=repeat, args=(name, actions[name]))
        for name in ["load", "load", "store", "store", "update", "update", "gc", "gc"]
    ]
    for thread in threads:
        thread.start()
    stop.wait(3.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(counts.values()), counts  # every kind of transaction ran
    for tokens in kept:
        assert ns.lookup(tokens) == 128
