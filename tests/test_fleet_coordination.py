"""Coordination between nodes sharing one index and one extent directory.

Node processes (``tests/fleet_node.py``) with separate ``TenantKV``s share the test's index
(its PostgreSQL schema, or the SQLite file) and the cache root: one node's entries are the
others' hits, two stores of one prefix at once give one entry, a tenant's quota holds over the
sum of every node's stores, and key changes on one node hold on the others at their next
operation.

Two processes open the same root: node B streams a prefix while node A evicts it (a lower
quota), collects garbage and retires the tenant's keys. B's load must complete byte-exact with no
security event, because B's lease is a row in the index that A honours; the extent's bytes must
outlive the lease and no longer. Node B also sees A's key retirement through the key epoch and
drops its cached clear keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

import tenantkv
from tenantkv.index import leases
from tenantkv.index.schema import Block, Extent

from .helpers import MLA_SMALL, random_layers, random_tokens
from .indexes import Index

REPO = Path(__file__).resolve().parents[1]
TOKENS = 128


def _extent_ids(kv: tenantkv.TenantKV) -> set[str]:
    with kv.context.index.read() as session:
        return set(session.scalars(select(Extent.id)).all())


def _lease_rows(kv: tenantkv.TenantKV) -> set[str]:
    """Extents with a live lease row (what other nodes see), without this node's local holds."""
    with kv.context.index.read() as session:
        return leases.leased(session, None, time.time())


def _extent_path(root: Path, extent_id: str) -> Path:
    return root / "blocks" / "extents" / extent_id[:2] / f"{extent_id}.tkx"


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class Node:
    """A node process in serve mode (see ``tests/fleet_node.py``)."""

    def __init__(self, root: Path, database_url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_node", "serve", str(root), database_url],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        self._stdout = self.process.stdout

    def ready(self) -> None:
        assert self._stdout.readline().strip() == "ready"

    def send(self, **request: Any) -> None:
        self._stdin.write(json.dumps(request) + "\n")
        self._stdin.flush()

    def receive(self) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self._stdout.readline())
        return answer

    def ask(self, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self.receive()

    def stop(self) -> None:
        self._stdin.close()
        try:
            assert self.process.wait(timeout=60) == 0
        finally:
            if self.process.poll() is None:
                self.process.kill()


@contextmanager
def nodes(root: Path, database_url: str, count: int) -> Iterator[list[Node]]:
    """``count`` node processes on ``root``, started together, stopped (exit 0) at the end."""
    started = [Node(root, database_url) for _ in range(count)]
    try:
        for node in started:
            node.ready()
        yield started
    except BaseException:
        for node in started:
            node.process.kill()
        raise
    for node in started:
        node.stop()


ALL_EXACT = {"exact": [True] * MLA_SMALL.num_layers}


def _tenant_bytes(kv: tenantkv.TenantKV) -> int:
    with kv.context.index.read() as session:
        return int(session.scalar(select(func.coalesce(func.sum(Extent.size_bytes), 0))) or 0)


def _extent_files(root: Path) -> set[str]:
    return {path.stem for path in (root / "blocks" / "extents").glob("*/*.tkx")}


def test_nodes_share_entries_store_one_prefix_once_and_keep_the_quota_together(
    tmp_path: Path, index: Index
) -> None:
    root = tmp_path / "cache"
    with tenantkv.open(root, durable=False) as admin:
        admin.create_tenant("acme", quota_bytes=2**30)
        with nodes(root, index.url(root), 2) as (one, two):
            # node 1 stores, node 2 hits and loads byte-exact (and so does this process)
            assert one.ask(op="store", seeds=[10]) == {"stored": [TOKENS]}
            assert two.ask(op="lookup", seed=10) == {"hit": TOKENS}
            assert two.ask(op="load", seed=10) == ALL_EXACT
            ns = admin.namespace("acme", model="fleet-model", layout=MLA_SMALL)
            assert ns.lookup(random_tokens(TOKENS, seed=12)) == 0  # control: a miss is a miss

            # both store one prefix at once: one entry, one set of block rows, no stray bytes
            at = time.time() + 0.3
            for node in (one, two):
                node.send(op="store", seeds=[11], at=at)
            stored = sorted(node.receive()["stored"][0] for node in (one, two))
            assert stored[1] == TOKENS and stored[0] in (0, TOKENS)
            with admin.context.index.read() as session:
                assert session.scalar(select(func.count()).select_from(Block)) == 4
                referenced = set(session.scalars(select(Block.extent_id).distinct()))
            assert _extent_ids(admin) == referenced and len(referenced) == 2
            assert _extent_files(root) == referenced
            assert one.ask(op="load", seed=11) == ALL_EXACT
            assert two.ask(op="load", seed=11) == ALL_EXACT

            # a quota of three extents holds over both nodes' concurrent stores
            extent_bytes = _tenant_bytes(admin) // 2
            quota = 3 * extent_bytes
            admin.update_tenant("acme", quota_bytes=quota)
            seen: list[int] = []
            storing = threading.Event()
            storing.set()

            def watch() -> None:
                while storing.is_set():
                    seen.append(_tenant_bytes(admin))

            watcher = threading.Thread(target=watch)
            watcher.start()
            at = time.time() + 0.3
            one.send(op="store", seeds=list(range(20, 26)), at=at)
            two.send(op="store", seeds=list(range(30, 36)), at=at)
            try:
                answers = [one.receive(), two.receive()]
            finally:
                storing.clear()
                watcher.join()
            assert answers == [{"stored": [TOKENS] * 6}] * 2  # every store fit, by evicting
            assert len(seen) > 1 and max(seen) <= quota
            assert _tenant_bytes(admin) == quota  # full, not over
            # three prefixes survive (which ones depends on how the stores interleaved), and
            # each node loads them byte-exact
            kept = [s for s in range(20, 36) if ns.lookup(random_tokens(TOKENS, seed=s))]
            assert len(kept) == 3
            assert one.ask(op="load", seed=kept[0]) == ALL_EXACT
            assert two.ask(op="load", seed=kept[-1]) == ALL_EXACT
            for node in (one, two):
                assert node.ask(op="events")["security_events"] == {}
        assert admin.security_events() == {}


def test_key_changes_on_one_node_hold_on_the_others_at_once(tmp_path: Path, index: Index) -> None:
    root = tmp_path / "cache"
    with tenantkv.open(root, durable=False) as admin:
        admin.create_tenant("acme", quota_bytes=2**30)
        ns = admin.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        ns.store(random_tokens(TOKENS, seed=40), random_layers(MLA_SMALL, TOKENS, seed=40))
        with nodes(root, index.url(root), 1) as (other,):
            assert other.ask(op="load", seed=40) == ALL_EXACT  # it now caches the clear key
            # rotation: old entries still load; the other node's new store uses the new version
            assert admin.rotate_keys("acme") == 2
            assert other.ask(op="load", seed=40) == ALL_EXACT
            assert other.ask(op="store", seeds=[41]) == {"stored": [TOKENS]}
            with admin.context.index.read() as session:
                assert set(session.scalars(select(Extent.key_version))) == {1, 2}
            # retirement re-seals under version 2 and destroys version 1: the other node's next
            # load, with no wait, reads the re-sealed extent exactly
            assert admin.retire_keys("acme")["retired_versions"] == [1]
            assert other.ask(op="load", seed=40) == ALL_EXACT
            assert other.ask(op="load", seed=41) == ALL_EXACT
            # deletion: the other node's next lookup misses and its load is a typed miss
            admin.delete_tenant("acme")
            assert other.ask(op="lookup", seed=40) == {"hit": 0}
            assert other.ask(op="load", seed=41) == {"error": "CacheMissError"}
            assert other.ask(op="events")["security_events"] == {}
        assert admin.security_events() == {}


def test_a_load_on_another_node_survives_eviction_gc_and_key_retirement(
    tmp_path: Path, index: Index
) -> None:
    root = tmp_path / "cache"
    with tenantkv.open(root, durable=False) as node_a:
        node_a.create_tenant("acme", quota_bytes=2**30)
        ns = node_a.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        assert ns.store(random_tokens(TOKENS, seed=1), random_layers(MLA_SMALL, TOKENS, 1)) == 128
        (busy,) = _extent_ids(node_a)
        node_a.rotate_keys("acme")  # the busy extent is sealed under version 1, now old
        # Control: an extent no load reads is stored under the new version and is evicted with
        # its bytes at once.
        assert ns.store(random_tokens(TOKENS, seed=2), random_layers(MLA_SMALL, TOKENS, 2)) == 128
        (idle,) = _extent_ids(node_a) - {busy}

        node_b = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fleet_node",
                str(root),
                index.url(root),
                "1",
                str(TOKENS),
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert node_b.stdout is not None and node_b.stdin is not None
            assert node_b.stdout.readline().strip() == "leased"
            # B's lease row (written just after its load started) is visible to A
            assert _wait_for(lambda: busy in node_a.leased_extents())

            # 1. A lowers the quota below one extent: both leave the index; the idle one's
            #    bytes go now, the busy one's stay while B's lease holds.
            node_a.update_tenant("acme", quota_bytes=1024)
            assert ns.lookup(random_tokens(TOKENS, seed=1)) == 0
            assert _extent_ids(node_a) == set()
            assert not _extent_path(root, idle).exists()
            assert _extent_path(root, busy).exists()
            # 2. GC with no grace: an unindexed file under a live lease is not an orphan.
            node_a.gc(orphan_grace=0)
            assert _extent_path(root, busy).exists()
            # 3. Retiring keys: nothing indexed uses version 1 any more, so it is destroyed.
            assert node_a.retire_keys("acme")["retired_versions"] == [1]
            assert _extent_path(root, busy).exists()

            node_b.stdin.write("go\n")
            node_b.stdin.flush()
            report = json.loads(node_b.stdout.readline())
            assert node_b.wait(timeout=60) == 0
        finally:
            if node_b.poll() is None:
                node_b.kill()
        # B's load completed byte-exact with no security event ...
        assert report["exact"] == [True] * MLA_SMALL.num_layers
        assert report["security_events"] == {}
        # ... B noticed A's key change and dropped the clear keys it had cached ...
        assert report["keys_cached_before"] and report["keys_cached_after"] == []
        # ... and the bytes went when B's lease ended (B's release removed them).
        assert not _extent_path(root, busy).exists()
        assert node_a.leased_extents() == set()
        assert node_a.security_events().get("segment_open_failed") is None
        assert node_a.health_counters().get("lost_extents") is None


def test_a_lapsed_lease_no_longer_protects_the_bytes(tmp_path: Path, index: Index) -> None:
    """A node that dies mid-load stops renewing its lease; after it lapses, GC removes the
    evicted extent's bytes as an orphan."""
    root = tmp_path / "cache"
    # Leases run on the wall clock. The lease must outlive the control's steps (its row written
    # in the background, the quota change, a GC): 0.5 s lapsed before them on a loaded host.
    with tenantkv.open(root, durable=False, lease_seconds=3.0) as kv:
        kv.create_tenant("acme", quota_bytes=2**30)
        ns = kv.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        tokens = random_tokens(TOKENS, seed=3)
        ns.store(tokens, random_layers(MLA_SMALL, TOKENS, 3))
        (extent,) = _extent_ids(kv)
        stream = ns.load(tokens)
        assert _wait_for(lambda: extent in _lease_rows(kv))  # its row is written shortly after
        # as if this node died: no renewal, and no release
        kv.context.leases.forget(next(iter(kv.context.leases.active())))
        kv.update_tenant("acme", quota_bytes=1024)
        kv.gc(orphan_grace=0)
        assert _extent_path(root, extent).exists()  # control: the lease still holds
        assert _wait_for(lambda: not kv.leased_extents())
        kv.gc(orphan_grace=0)
        assert not _extent_path(root, extent).exists()
        stream.close()
