"""Data-plane metrics (tenantkv/components/metrics.py): the counters move as the cache works.

A real sequence on one cache (lookups that miss and hit, stores, a load, an eviction, a lost
extent, a tampered one), each figure compared with what the operation did; the tenant label only
when enabled; two caches keep separate registries; tier hits come from a store's own counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest

import tenantkv
from tenantkv import TenantKV
from tenantkv.components.health import SCRUB_PENDING
from tenantkv.datapath.extent_format import ExtentGeometry
from tests.helpers import MLA_SMALL, random_layers, random_tokens
from tests.indexes import Index

TOKENS = 128  # two blocks
LAYERS = MLA_SMALL.num_layers


def registry_of(kv: TenantKV) -> CollectorRegistry:
    registry = kv.metrics_registry
    assert registry is not None, "prometheus_client is installed: the cache has a registry"
    return registry


def sample(kv: TenantKV, name: str, **labels: str) -> float:
    value = registry_of(kv).get_sample_value(name, labels)
    return 0.0 if value is None else value


def extent_files(root: Path) -> set[Path]:
    return set((root / "blocks" / "extents").glob("*/*.tkx"))


def store(ns: tenantkv.Namespace, root: Path, tokens: list[int], seed: int) -> Path:
    """Store ``tokens``; return the extent file it wrote."""
    before = extent_files(root)
    assert ns.store(tokens, random_layers(MLA_SMALL, len(tokens), seed=seed)) == len(tokens)
    (created,) = extent_files(root) - before
    return created


def load_layers(ns: tenantkv.Namespace, tokens: list[int]) -> int:
    """Load ``tokens`` layer by layer; return how many layers were handed over."""
    handed = 0
    with ns.load(tokens) as stream:
        for _index, _layer in stream:
            handed += 1
    return handed


def test_counters_follow_lookup_store_load_evict_lost_and_tampered(
    kv: TenantKV, cache_root: Path
) -> None:
    extent_bytes = ExtentGeometry(
        num_blocks=TOKENS // 64,
        num_layers=LAYERS,
        segment_bytes=64 * MLA_SMALL.token_bytes,
        suite=kv.config.suite,
    ).total_bytes
    # room for one extent: a second store evicts the first
    kv.create_tenant("acme", quota_bytes=extent_bytes * 3 // 2)
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    first, second, third = (random_tokens(TOKENS, seed=s) for s in (1, 2, 3))

    assert ns.lookup(first) == 0  # a miss: every token counts as missed
    assert sample(kv, "tenantkv_miss_tokens_total") == TOKENS
    assert sample(kv, "tenantkv_hit_tokens_total") == 0

    store(ns, cache_root, first, seed=1)
    assert sample(kv, "tenantkv_stored_bytes_total") == extent_bytes
    assert ns.lookup(first) == TOKENS  # positive control: the owner hits
    assert sample(kv, "tenantkv_hit_tokens_total") == TOKENS
    assert sample(kv, "tenantkv_miss_tokens_total") == TOKENS  # unchanged by the hit

    assert load_layers(ns, first) == LAYERS
    assert sample(kv, "tenantkv_loaded_bytes_total") == TOKENS * MLA_SMALL.token_bytes * LAYERS
    assert sample(kv, "tenantkv_load_seconds_count") == 1
    assert sample(kv, "tenantkv_time_to_first_layer_seconds_count") == 1
    load_sum = sample(kv, "tenantkv_load_seconds_sum")
    assert 0 < sample(kv, "tenantkv_time_to_first_layer_seconds_sum") <= load_sum < 10

    second_file = store(ns, cache_root, second, seed=2)  # evicts the first extent
    assert ns.lookup(first) == 0
    assert sample(kv, "tenantkv_evicted_extents_total") == 1
    assert sample(kv, "tenantkv_evicted_bytes_total") == extent_bytes
    assert sample(kv, "tenantkv_stored_bytes_total") == 2 * extent_bytes
    assert sample(kv, "tenantkv_expired_extents_total") == 0

    second_file.unlink()  # lost bytes: a miss, counted, no security event
    with pytest.raises(tenantkv.CacheMissError):
        ns.load(second)
    assert sample(kv, "tenantkv_lost_extents_total") == 1
    assert sample(kv, "tenantkv_health_events_total", kind="lost_extents") == 1
    assert sample(kv, "tenantkv_integrity_events_total") == 0
    assert sample(kv, "tenantkv_load_seconds_count") == 1  # no stream, no observation

    third_file = store(ns, cache_root, third, seed=3)
    geometry = ExtentGeometry(TOKENS // 64, LAYERS, 64 * MLA_SMALL.token_bytes, kv.config.suite)
    data = bytearray(third_file.read_bytes())
    data[geometry.offset(1, 0) + 5] ^= 0x01  # layer 1 fails to open; layer 0 is intact
    third_file.write_bytes(bytes(data))
    with pytest.raises(tenantkv.SegmentIntegrityError):
        load_layers(ns, third)
    assert sample(kv, "tenantkv_integrity_events_total") == 1
    assert sample(kv, "tenantkv_security_events_total", kind="segment_open_failed") == 1
    assert sample(kv, "tenantkv_lost_extents_total") == 1
    # layer 0 was handed over: one more first-layer time, no complete-load time
    assert sample(kv, "tenantkv_time_to_first_layer_seconds_count") == 2
    assert sample(kv, "tenantkv_load_seconds_count") == 1
    assert sample(kv, "tenantkv_loaded_bytes_total") == TOKENS * MLA_SMALL.token_bytes * (
        LAYERS + 1
    )
    # no tenant label, and no tenant name anywhere, by default
    text = generate_latest(registry_of(kv)).decode()
    assert "acme" not in text and "tenant=" not in text


def test_loaded_bytes_count_the_stored_codes_and_metering_the_tokens(kv: TenantKV) -> None:
    """Under codec fp8 a load reads half the bytes of the layers it hands over (one e4m3 code a
    value, and a float32 scale per block, layer and component): the metric counts those stored
    bytes, the usage meter still counts the tokens served (and the decoded bytes handed over,
    docs/admin-api.md)."""
    kv.create_tenant("acme")
    plain = kv.namespace("acme", model="m", layout=MLA_SMALL)
    coded = kv.namespace("acme", model="m", layout=MLA_SMALL, codec="fp8")
    tokens = random_tokens(TOKENS, seed=6)
    layers = random_layers(MLA_SMALL, TOKENS, seed=6)
    assert plain.store(tokens, layers) == TOKENS and coded.store(tokens, layers) == TOKENS

    assert load_layers(plain, tokens) == LAYERS  # positive control: codec none, values' bytes
    decoded = TOKENS * MLA_SMALL.token_bytes * LAYERS
    assert sample(kv, "tenantkv_loaded_bytes_total") == decoded
    served = kv.usage("acme").counters
    assert served["served_tokens"] == TOKENS and served["served_bytes"] == decoded

    assert load_layers(coded, tokens) == LAYERS
    segment = 64 * MLA_SMALL.values_per_token + 2 * 4  # codes, and c_KV's and k_rot's scales
    assert coded.layout.segment_bytes(64) == segment
    stored = TOKENS // 64 * segment * LAYERS
    assert sample(kv, "tenantkv_loaded_bytes_total") == decoded + stored
    assert stored < decoded * 0.51
    served = kv.usage("acme").counters
    assert served["served_tokens"] == 2 * TOKENS  # metering counts tokens, whatever the codec
    assert served["served_bytes"] == 2 * decoded


def test_tenant_label_only_when_enabled(cache_root: Path) -> None:
    tokens = random_tokens(TOKENS, seed=4)
    with tenantkv.open(cache_root, durable=False, metrics_tenant_labels=True) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        store(ns, cache_root, tokens, seed=4)
        assert ns.lookup(tokens) == TOKENS
        assert kv.namespace("globex", model="m", layout=MLA_SMALL).lookup(tokens) == 0
        assert load_layers(ns, tokens) == LAYERS
        assert sample(kv, "tenantkv_hit_tokens_total", tenant="acme") == TOKENS
        assert sample(kv, "tenantkv_miss_tokens_total", tenant="globex") == TOKENS
        assert sample(kv, "tenantkv_hit_tokens_total", tenant="globex") == 0
        assert sample(kv, "tenantkv_load_seconds_count", tenant="acme") == 1
        # the unlabelled series does not exist when the label is on
        assert registry_of(kv).get_sample_value("tenantkv_hit_tokens_total") is None
        assert 'tenant="acme"' in generate_latest(registry_of(kv)).decode()


def test_two_caches_in_one_process_keep_separate_registries(tmp_path: Path, index: Index) -> None:
    tokens = random_tokens(TOKENS, seed=5)
    with (
        tenantkv.open(tmp_path / "a", durable=False) as a,
        tenantkv.open(tmp_path / "b", durable=False) as b,
    ):
        assert a.metrics_registry is not b.metrics_registry
        for kv in (a, b):
            kv.create_tenant("acme")
        assert a.namespace("acme", model="m", layout=MLA_SMALL).lookup(tokens) == 0
        assert sample(a, "tenantkv_miss_tokens_total") == TOKENS  # positive control
        assert sample(b, "tenantkv_miss_tokens_total") == 0
    # and neither registered anything in the process-wide default registry
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("tenantkv_miss_tokens_total") is None


def test_tier_hits_degraded_operations_and_scrub_level_are_read_when_scraped(
    kv: TenantKV,
) -> None:
    tiers = {"redis": 3}
    kv.context.metrics.watch_tiers(lambda: tiers)  # what a tiered block store wires in
    assert sample(kv, "tenantkv_tier_hits_total", tier="redis") == 3
    tiers.update(redis=5, file=2)
    assert sample(kv, "tenantkv_tier_hits_total", tier="redis") == 5
    assert sample(kv, "tenantkv_tier_hits_total", tier="file") == 2

    tokens = random_tokens(TOKENS, seed=6)
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    assert ns.lookup(tokens) == 0  # control: the index answers, a counted miss
    assert sample(kv, "tenantkv_miss_tokens_total") == TOKENS
    with kv.context.index.engine.begin() as connection:  # the index loses its tables
        connection.exec_driver_sql("ALTER TABLE tkv_blocks RENAME TO tkv_blocks_lost")
    try:
        assert ns.lookup(tokens) == 0
    finally:
        with kv.context.index.engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE tkv_blocks_lost RENAME TO tkv_blocks")
    assert sample(kv, "tenantkv_degraded_operations_total", operation="lookup") == 1
    assert sample(kv, "tenantkv_miss_tokens_total") == TOKENS  # an outage is not a miss

    assert sample(kv, "tenantkv_scrub_pending") == 0
    kv.context.health.set(SCRUB_PENDING, 1)  # what the shredding service sets
    assert sample(kv, "tenantkv_scrub_pending") == 1


def test_opens_served_by_the_ring_of_recent_writes_are_counted(
    tmp_path: Path, index: Index
) -> None:
    tokens = random_tokens(TOKENS, seed=9)
    with tenantkv.open(tmp_path / "cache") as kv:  # durable: extents written with O_DIRECT
        if getattr(kv.context.blocks, "recent", None) is None:
            pytest.skip("this platform has no O_DIRECT")
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        assert ns.store(tokens, random_layers(MLA_SMALL, TOKENS, seed=9)) == TOKENS
        assert sample(kv, "tenantkv_tier_hits_total", tier="recent_writes") == 0
        assert load_layers(ns, tokens) == LAYERS
        assert sample(kv, "tenantkv_tier_hits_total", tier="recent_writes") == 1
    with tenantkv.open(tmp_path / "cache", recent_writes_bytes=0) as kv:  # control: no ring
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        assert load_layers(ns, tokens) == LAYERS
        labels = {"tier": "recent_writes"}
        assert registry_of(kv).get_sample_value("tenantkv_tier_hits_total", labels) is None


def test_a_tiered_stores_local_rings_count_their_hits_and_the_extents_they_keep(
    tmp_path: Path, index: Index
) -> None:
    tokens = random_tokens(TOKENS, seed=10)
    url = f"file://{tmp_path / 'hot'},file://{tmp_path / 'cold'}"
    with tenantkv.open(tmp_path / "cache", block_store_url=url) as kv:  # durable: O_DIRECT
        tiers = getattr(kv.context.blocks, "tiers", [])
        if len(tiers) != 2 or any(tier.recent is None for tier in tiers):
            pytest.skip("this platform has no O_DIRECT")
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        assert ns.store(tokens, random_layers(MLA_SMALL, TOKENS, seed=10)) == TOKENS
        # both tiers wrote the extent, and each tier's ring kept it
        assert sample(kv, "tenantkv_recent_writes_extents_total", outcome="kept") == 2
        assert sample(kv, "tenantkv_recent_writes_extents_total", outcome="left_out") == 0
        assert load_layers(ns, tokens) == LAYERS
        assert sample(kv, "tenantkv_tier_hits_total", tier="recent_writes") == 1  # the hot one


def test_extents_larger_than_the_ring_are_counted_as_left_out(tmp_path: Path, index: Index) -> None:
    tokens = random_tokens(TOKENS, seed=11)
    with tenantkv.open(tmp_path / "cache", recent_writes_bytes=4096) as kv:  # one page
        if getattr(kv.context.blocks, "recent", None) is None:
            pytest.skip("this platform has no O_DIRECT")
        kv.create_tenant("acme")
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        assert ns.store(tokens, random_layers(MLA_SMALL, TOKENS, seed=11)) == TOKENS
        assert sample(kv, "tenantkv_recent_writes_extents_total", outcome="left_out") == 1
        assert sample(kv, "tenantkv_recent_writes_extents_total", outcome="kept") == 0
        assert load_layers(ns, tokens) == LAYERS  # from the disk
        assert sample(kv, "tenantkv_tier_hits_total", tier="recent_writes") == 0
    with tenantkv.open(tmp_path / "cache", recent_writes_bytes=0) as kv:  # control: no ring
        ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
        assert load_layers(ns, tokens) == LAYERS
        labels = {"outcome": "left_out"}
        registry = registry_of(kv)
        assert registry.get_sample_value("tenantkv_recent_writes_extents_total", labels) is None
