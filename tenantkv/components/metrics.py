"""Data-plane metrics of one open cache, in its own ``prometheus_client`` registry.

The embedding inference server exposes them (``generate_latest(kv.metrics_registry)``, or
``make_asgi_app(kv.metrics_registry)``): hit and miss tokens, bytes loaded and stored, load and
time-to-first-layer histograms, evictions and expiries, lost extents, integrity (security)
events, degraded operations, and per-tier hits of a tiered block store.

Why a registry per cache, not the process-wide default: two caches in one process (and every
test) would otherwise share, or collide on, the same metric names.

Why tenant labels are opt-in (``CacheConfig.metrics_tenant_labels``): whoever can read the
metrics (a scraper, a dashboard, a metrics vendor) then learns every tenant's name and how much
each one uses the cache. Namespace scopes are never labels: they are chosen by the embedding
code, unbounded in number, and may name end users.

Cost: every update is O(1) and takes only ``prometheus_client``'s own short lock; nothing here
does I/O. A load is observed once, when it is closed (off its critical path); health and security
counts are read from their own counters only when scraped.

``prometheus_client`` is the optional extra ``metrics`` (the admin server's extra brings it too).
Without it :func:`new_metrics` returns :class:`DataPlaneMetrics`, whose updates do nothing, and
``registry`` is None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .health import INCOMPLETE_SCRUBS, LOST_EXTENTS, SCRUB_PENDING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError:  # the optional extra is not installed: metrics are no-ops
    prometheus_client = None  # type: ignore[assignment]

#: Seconds, from 1 ms (a warm 8K-token load's first layer takes ~3 ms) to 10 s.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)

#: The security event kind of bytes that failed to open (tampering or corruption).
INTEGRITY_EVENT = "segment_open_failed"
_DEGRADED_PREFIX = "degraded_"

CountsSource = Callable[[], Mapping[str, int]]


def available() -> bool:
    """Whether ``prometheus_client`` is installed (else metrics are no-ops)."""
    return prometheus_client is not None


class DataPlaneMetrics:
    """The interface the services call; this base class records nothing (no
    ``prometheus_client``). ``tenant`` is the tenant's name; it becomes a label only when
    tenant labels were enabled."""

    #: The registry to expose, or None when ``prometheus_client`` is not installed.
    registry: CollectorRegistry | None = None
    tenant_labels: bool = False

    def looked_up(self, tenant: str, hit_tokens: int, miss_tokens: int) -> None:
        """A metered lookup: ``hit_tokens`` found cached, ``miss_tokens`` not."""

    def stored(self, tenant: str, nbytes: int) -> None:
        """A store wrote an extent of ``nbytes`` (sealed, as metered)."""

    def loaded(
        self,
        tenant: str,
        nbytes: int,
        *,
        seconds: float | None,
        first_layer_seconds: float | None,
    ) -> None:
        """A closed load read ``nbytes`` of stored KV for the layers it handed over (a codec's
        codes, before decoding: what was read and decrypted). ``seconds`` (to its last layer)
        is None unless every layer was handed over; ``first_layer_seconds`` is None unless
        layer 0 was."""

    def removed(self, tenant: str, extents: int, nbytes: int, *, expired: bool) -> None:
        """Extents left the cache: evicted for room (LRU, a lowered quota) or expired."""

    def watch_tiers(self, stats: CountsSource) -> None:
        """Expose ``stats()`` (hits by tier name, e.g. ``{"redis": 10, "file": 3}``) as
        ``tenantkv_tier_hits_total{tier}``, read at each scrape. A tiered block store wires
        itself with one line: ``kv.context.metrics.watch_tiers(lambda: store.stats()["hits"])``.
        """

    def watch_recent_writes(self, counts: CountsSource) -> None:
        """Expose ``counts()`` (``kept`` and ``left_out`` extents of the rings of recent writes)
        as ``tenantkv_recent_writes_extents_total{outcome}``, read at each scrape: extents left
        out (larger than the ring, or their place still being read) load from the device the
        first time, so a share that grows says the ring is too small for the stores."""


def new_metrics(
    *,
    tenant_labels: bool,
    health: CountsSource,
    security_events: CountsSource,
) -> DataPlaneMetrics:
    """The metrics of one cache: recording ones if ``prometheus_client`` is installed."""
    if prometheus_client is None:
        return DataPlaneMetrics()
    return _PrometheusMetrics(tenant_labels, health, security_events)


class _PrometheusMetrics(DataPlaneMetrics):
    def __init__(
        self, tenant_labels: bool, health: CountsSource, security_events: CountsSource
    ) -> None:
        assert prometheus_client is not None, "only built when prometheus_client is installed"
        registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.registry = registry
        self.tenant_labels = tenant_labels
        labels = ("tenant",) if tenant_labels else ()

        # Unlabelled metrics sit behind the same ``labels(tenant)`` call as labelled ones, so
        # the update paths do not branch on the setting.
        def bind(metric: Any) -> Any:
            return metric if tenant_labels else _Unlabelled(metric)

        def counter(name: str, doc: str) -> Any:
            return bind(prometheus_client.Counter(name, doc, labels, registry=registry))

        def histogram(name: str, doc: str) -> Any:
            return bind(
                prometheus_client.Histogram(
                    name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry
                )
            )

        self._hit_tokens = counter("tenantkv_hit_tokens", "Tokens that lookups found cached.")
        self._miss_tokens = counter(
            "tenantkv_miss_tokens", "Tokens that lookups did not find cached (to prefill)."
        )
        self._loaded_bytes = counter(
            "tenantkv_loaded_bytes",
            "Stored bytes of KV (plaintext, a codec's codes before decoding) that loads read.",
        )
        self._stored_bytes = counter(
            "tenantkv_stored_bytes", "Bytes of extents (sealed) that stores wrote."
        )
        self._load_seconds = histogram(
            "tenantkv_load_seconds", "Time from load() to its last layer, of complete loads."
        )
        self._first_layer_seconds = histogram(
            "tenantkv_time_to_first_layer_seconds", "Time from load() to its layer 0."
        )
        self._evicted_extents = counter(
            "tenantkv_evicted_extents", "Extents evicted to make room (LRU or a lowered quota)."
        )
        self._evicted_bytes = counter("tenantkv_evicted_bytes", "Bytes of evicted extents.")
        self._expired_extents = counter(
            "tenantkv_expired_extents", "Extents removed when their retention ran out."
        )
        self._expired_bytes = counter("tenantkv_expired_bytes", "Bytes of expired extents.")
        self._tiers = _SummedCounts(
            "tenantkv_tier_hits", "Reads served by each tier of the block store.", "tier"
        )
        registry.register(self._tiers)
        self._recent_writes = _SummedCounts(
            "tenantkv_recent_writes_extents",
            "Extents written with O_DIRECT that the ring of recent writes kept or left out.",
            "outcome",
        )
        registry.register(self._recent_writes)
        registry.register(_HealthAndSecurity(health, security_events))

    def looked_up(self, tenant: str, hit_tokens: int, miss_tokens: int) -> None:
        if hit_tokens:
            self._hit_tokens.labels(tenant).inc(hit_tokens)
        if miss_tokens:
            self._miss_tokens.labels(tenant).inc(miss_tokens)

    def stored(self, tenant: str, nbytes: int) -> None:
        self._stored_bytes.labels(tenant).inc(nbytes)

    def loaded(
        self,
        tenant: str,
        nbytes: int,
        *,
        seconds: float | None,
        first_layer_seconds: float | None,
    ) -> None:
        if nbytes:
            self._loaded_bytes.labels(tenant).inc(nbytes)
        if first_layer_seconds is not None:
            self._first_layer_seconds.labels(tenant).observe(first_layer_seconds)
        if seconds is not None:
            self._load_seconds.labels(tenant).observe(seconds)

    def removed(self, tenant: str, extents: int, nbytes: int, *, expired: bool) -> None:
        if expired:
            self._expired_extents.labels(tenant).inc(extents)
            self._expired_bytes.labels(tenant).inc(nbytes)
        else:
            self._evicted_extents.labels(tenant).inc(extents)
            self._evicted_bytes.labels(tenant).inc(nbytes)

    def watch_tiers(self, stats: CountsSource) -> None:
        self._tiers.sources.append(stats)

    def watch_recent_writes(self, counts: CountsSource) -> None:
        self._recent_writes.sources.append(counts)


class _Unlabelled:
    """A metric without labels behind the same ``labels(tenant)`` call as a labelled one."""

    __slots__ = ("_metric",)

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def labels(self, _tenant: str) -> Any:
        return self._metric


class _SummedCounts:
    """A counter family with one label, read from counts sources at scrape time: each label
    value's counts summed over the sources (no series without one). Serves
    ``tenantkv_tier_hits_total{tier}`` (the block stores' own counts) and
    ``tenantkv_recent_writes_extents_total{outcome}`` (the rings')."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self.sources: list[CountsSource] = []
        self._name = name
        self._documentation = documentation
        self._label = label

    def describe(self) -> list[Any]:
        return [CounterMetricFamily(self._name, "", labels=[self._label])]

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        totals: dict[str, int] = {}
        for source in self.sources:
            for key, count in source().items():
                totals[key] = totals.get(key, 0) + int(count)
        for key, count in sorted(totals.items()):
            family.add_metric([key], count)
        yield family


class _HealthAndSecurity:
    """The health counters (:mod:`tenantkv.components.health`) and the security event counts,
    read when scraped (recording them costs the data path nothing more). By kind only, never by
    tenant: these counters keep none."""

    _NAMES = (
        "tenantkv_security_events",
        "tenantkv_integrity_events",
        "tenantkv_health_events",
        "tenantkv_lost_extents",
        "tenantkv_degraded_operations",
        "tenantkv_incomplete_scrubs",
        "tenantkv_scrub_pending",
    )

    def __init__(self, health: CountsSource, security_events: CountsSource) -> None:
        self._health = health
        self._security_events = security_events

    def describe(self) -> list[Any]:
        return [GaugeMetricFamily(name, "") for name in self._NAMES]

    def collect(self) -> Iterator[Any]:
        security = dict(self._security_events())
        health = dict(self._health())
        pending = health.pop(SCRUB_PENDING, 0)
        family = CounterMetricFamily(
            "tenantkv_security_events",
            "Security events recorded by this process, by kind.",
            labels=["kind"],
        )
        for kind, count in sorted(security.items()):
            family.add_metric([kind], count)
        yield family
        yield CounterMetricFamily(
            "tenantkv_integrity_events",
            "Extents whose bytes failed to open (tampering or corruption; security events).",
            value=security.get(INTEGRITY_EVENT, 0),
        )
        family = CounterMetricFamily(
            "tenantkv_health_events",
            "Faults of this process that are not security events: lost extents, operations "
            "degraded to a miss, incomplete scrubs.",
            labels=["kind"],
        )
        for kind, count in sorted(health.items()):
            family.add_metric([kind], count)
        yield family
        yield CounterMetricFamily(
            "tenantkv_lost_extents",
            "Extents whose bytes were gone or short (a miss, not a security event).",
            value=health.get(LOST_EXTENTS, 0),
        )
        family = CounterMetricFamily(
            "tenantkv_degraded_operations",
            "Operations that degraded to a miss because the index or block store failed.",
            labels=["operation"],
        )
        for kind, count in sorted(health.items()):
            if kind.startswith(_DEGRADED_PREFIX):
                family.add_metric([kind.removeprefix(_DEGRADED_PREFIX)], count)
        yield family
        yield CounterMetricFamily(
            "tenantkv_incomplete_scrubs",
            "Shreddings whose destroyed keys stayed in the index's files for a while.",
            value=health.get(INCOMPLETE_SCRUBS, 0),
        )
        yield GaugeMetricFamily(
            "tenantkv_scrub_pending",
            "1 while shredded keys may still be in the index's files (an incomplete scrub that "
            "the next GC run retries), else 0.",
            value=pending,
        )
