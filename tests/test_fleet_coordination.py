"""Coordination between nodes sharing one index and one extent directory.

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
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select

import tenantkv
from tenantkv.index import leases
from tenantkv.index.schema import Extent

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
    with tenantkv.open(root, durable=False, lease_seconds=0.5) as kv:
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
