"""CacheConfig: every setting of a cache, and every default, in one place.

The library (``tenantkv.open``), the CLI and the admin service all build a cache from a
:class:`CacheConfig`, so they agree on where things live and how big things are. A config is
frozen: a change is a new config (``dataclasses.replace`` or ``open(config, **overrides)``).
``CacheConfig.from_env()`` reads ``TENANTKV_*`` variables for the CLI and the server; the library
never reads the environment for settings (except the master key, see :mod:`tenantkv.crypto`).

The store's capacity and whether quotas may overcommit it are not settings: they are index
state shared by every node, changed only by an explicit, audited operator call
(``TenantKV.set_capacity``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from . import crypto, host_cpus
from .crypto import (
    DEFAULT_SUITE,
    CipherSuite,
    KeyEncryptionKey,
    KeyWrapper,
    MasterKeyProvider,
    default_master_key_provider,
)
from .errors import InvalidRequestError, MasterKeyError
from .settings_file import CONFIG_ENV, ENV_PREFIX, Section, SettingsFile
from .storage import BlockStore, BlockStoreUrlError, check_block_store_url, open_block_store

DEFAULT_ROOT = "./tenantkv-data"
MiB = 2**20
#: The longest duration a setting takes (a year): finite, and far below the timeouts' limits.
MAX_SECONDS = 366 * 86400.0


#: The index URLs tenantkv runs on (the scheme, before ``://``), and what to write instead of a
#: near miss: SQLAlchemy reads ``postgres://`` as no dialect at all, and plain ``postgresql://``
#: as psycopg2, which no extra installs.
DATABASE_SCHEMES: Final = ("sqlite", "postgresql+psycopg")
_NEAR_MISSES: Final = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg2": "postgresql+psycopg",
    "sqlite+pysqlite": "sqlite",
}


def _check_database_url(url: object) -> None:
    """Refuse, in one sentence, an index URL tenantkv does not run on (MySQL, a ``postgres://``
    URL copied from a hosting panel, a typo) before any driver is loaded."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidRequestError(
            f"database_url {url!r} is not a URL: use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        )
    scheme, _, rest = url.partition("://")
    if scheme in DATABASE_SCHEMES:
        return
    hint = _NEAR_MISSES.get(scheme)
    instead = (
        f"write {hint}://{rest.rpartition('@')[2]} (with your user)"
        if hint
        else "tenantkv's index runs on SQLite (sqlite:///PATH) or PostgreSQL "
        "(postgresql+psycopg://USER@HOST/DB, the postgres extra)"
    )
    raise InvalidRequestError(f"database_url scheme {scheme}:// is not supported: {instead}")


def default_database_url(root: Path) -> str:
    """The index of a cache rooted at ``root`` when no ``database_url`` is given."""
    return f"sqlite:///{root / 'index.db'}"


def default_block_store_url(root: Path) -> str:
    """Where extents live when no ``block_store_url`` is given: ``<root>/blocks``."""
    return (root / "blocks").resolve().as_uri()


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How to open a cache. Every field has its default here and nowhere else.

    ``database_url`` and ``block_store_url`` default to the embedded setup under ``root``
    (SQLite ``<root>/index.db``, extents in ``<root>/blocks``); ``master_key`` to the key file
    ``<root>/master.key`` (or ``TENANTKV_MASTER_KEY``).
    """

    root: Path = Path(DEFAULT_ROOT)
    #: SQLAlchemy URL of the index: ``sqlite:///...`` or ``postgresql+psycopg://...``.
    database_url: str | None = None
    #: Where extents live: ``file:///mnt/kv`` (a local directory or a shared POSIX mount),
    #: ``redis://host:6379/0?prefix=tkv:`` (Redis or Valkey; the ``redis`` extra), or tiers
    #: separated by commas, hottest first: ``redis://...,file:///mnt/kv`` (README "Block stores").
    block_store_url: str | None = None
    #: The master key: a provider (key file, environment, KMS hook) or a key wrapper.
    master_key: MasterKeyProvider | KeyWrapper | None = None
    #: AEAD suite new extents are sealed with (existing extents keep theirs).
    suite: CipherSuite = DEFAULT_SUITE
    #: fsync extents and directories before they become visible.
    durable: bool = True
    #: Let loads decrypt straight out of mapped extent files, one pass over memory fewer than
    #: reading them into a buffer first (docs/perf.md). Default (None): on where extents live
    #: on a local disk or memory file system and are written through the page cache
    #: (``direct_writes=False``); there with ``O_DIRECT`` writes, for segments of at least
    #: 64 KiB once their extent is in the page cache (``MAPPED_SEGMENT_BYTES`` in
    #: ``tenantkv.storage.local``); off on network and FUSE mounts, where a page the file
    #: system loses would kill the process (SIGBUS) instead of failing a read. Which is faster
    #: depends on the host: on an AMD EPYC VM mapped reads ran at 0.71-0.85x staged ones
    #: (docs/perf.md, "Mapped segments on an AMD EPYC VM"); False stages every read.
    map_reads: bool | None = None
    #: Write extents' whole pages with ``O_DIRECT``, past the page cache: faster stores where
    #: page-cache pages are costly to allocate, and a large store evicts no other tenant's hot
    #: extents; but a prefix's next load then reads the disk (unless it is still in the ring
    #: of recent writes, ``recent_writes_bytes``), and ``map_reads`` then maps only segments
    #: of 64 KiB and more, once the extent is in the page cache (docs/perf.md). Default
    #: (None): on for durable stores.
    direct_writes: bool | None = None
    #: Memory that keeps the sealed bytes of the extents this process wrote last, so that
    #: their first loads read memory instead of the device, where extents are written with
    #: ``O_DIRECT`` (``tenantkv.storage.recent_writes``: a ring, no copy at store time; an
    #: extent larger than it is not kept). A prefix is most often reused soon after it is
    #: stored; the first load of a 2,048-token prefix just stored took 9 ms instead of 28-34
    #: (docs/perf.md). One ring per tenant (``tenantkv.storage.recent_owners``), so one
    #: tenant's large stores never push another's out. Resident once written. Default (None,
    #: ``auto`` in the environment): an eighth of the memory available when the cache opens,
    #: at most 16 GiB; 0 turns it off.
    recent_writes_bytes: int | None = None
    #: One tenant's ring within ``recent_writes_bytes`` (default None: an eighth of it, at
    #: least 1 GiB where it holds that: a just-stored 8K-token DeepSeek-V3 prefix, 576 MB).
    #: The rings go to the tenants that store, a ring idle longest going to a new tenant once
    #: all are taken.
    recent_writes_tenant_bytes: int | None = None
    #: Raise CacheUnavailableError where the serving path would otherwise degrade to a miss.
    strict: bool = False
    #: Threads that seal stores (default: one per CPU the process can use, ``cores``: its
    #: affinity mask bounded by its cgroup CPU quota, not the host's count).
    seal_workers: int | None = None
    #: Threads that read and open the chunks of every load (default: ``max(2, seal_threads)``,
    #: so ``max(2, cores)`` where ``seal_workers`` is not set).
    load_workers: int | None = None
    #: Pin each loader and sealing thread to a CPU of its own, on CPUs this process claims
    #: host-wide, so that engine processes sharing a host pin to disjoint CPUs
    #: (``tenantkv.datapath.cpu_pinning``): unpinned, a load's or a store's workers often
    #: queued behind each other on one CPU for milliseconds while another idled. A pool stays
    #: unpinned where fewer CPUs than its threads are free. Turn off where busy threads of the
    #: embedding process are pinned to the same CPUs.
    pin_workers: bool = True
    #: Where processes claim the CPUs their pools pin to: one lock file per CPU, held by the
    #: process that pins there (``lslocks | grep tenantkv-cpus`` shows who). Default (None):
    #: ``/dev/shm/tenantkv-cpus`` (the temp dir's where there is no ``/dev/shm``), seen only by
    #: processes sharing that ``/dev/shm``; so a process whose cgroup CPU quota is below its CPU
    #: mask (a container with a CPU limit, whose neighbours have a ``/dev/shm`` of their own)
    #: leaves its pools unpinned unless this is set, to a directory every engine process on the
    #: host sees (a host path mounted into each container).
    cpu_claim_dir: Path | None = None
    #: Hold loader workers back for a caller blocked on layer 0 until it has the layer (at most
    #: ~2.5 ms; ``tenantkv.datapath.worker_hold``). Off: it saved ~0.3 ms of the first layer
    #: on 2-core machines only, and nothing within noise with a caller that computes between
    #: layers or inside vLLM (docs/perf.md).
    hold_workers_for_first_layer: bool = False
    #: Layers a load keeps ready ahead of its caller, and a store seals ahead of its writes
    #: (default: ``max(2, seal_threads)``, as ``load_workers``).
    window: int | None = None
    #: Host memory all loads use for ciphertext in flight, in slots of ``staging_slot_bytes``.
    #: A chunk (one slot of ciphertext) costs a read, a lock round trip and Python
    #: bookkeeping, so slots are large: 16 MiB holds a whole layer of an 8K-token DeepSeek-V3
    #: MLA prefix (9.4 MB), which a loader thread of an ``out=`` load then opens in one chunk
    #: (docs/perf.md, "Whole layers per worker"); 8 slots, as many as in 8 MiB slots before.
    staging_bytes: int = 128 * MiB
    staging_slot_bytes: int = 16 * MiB
    #: Host memory kept for recycling fresh CPU layers once callers drop them.
    layer_pool_bytes: int = 256 * MiB
    #: Block keys this node's lookups keep, over all namespaces, so that a lookup asks the index
    #: one statement instead of thousands of keys (``tenantkv.components.lookup_cache``; about
    #: 100 bytes each, so the default bounds it near 25 MiB). 0 turns it off.
    lookup_cache_keys: int = 262_144
    #: Quota of a tenant created without one.
    default_quota_bytes: int = 2**30
    #: Price of a token served from cache relative to a missed one.
    hit_cost: float = 1 / 50
    #: Seconds between background GC runs (None: no background GC).
    gc_interval: float | None = None
    #: Unindexed files younger than this are spared by the orphan sweep (a store writes its
    #: file just before it indexes it).
    orphan_grace: float = 600.0
    #: How long a load's lease on its extents lasts without renewal; a dead node's leases
    #: lapse after it.
    lease_seconds: float = 60.0
    #: Seconds the serving path (lookup, cached_length, prefetch, a store's index writes, a
    #: load's plan, lease writes and the key-epoch check) waits on a PostgreSQL index per
    #: transaction, connecting included, before it degrades as the serving policy says (a miss,
    #: a skipped store, ``CacheMissError`` before a load's first layer; ``strict``:
    #: CacheUnavailableError). A new connection takes at least 2 s (libpq's floor) when one is
    #: needed. SQLite has no network; its busy timeout applies instead (``tenantkv.index.bounds``,
    #: docs/deploy.md).
    index_serving_timeout: float = 2.0
    #: The same bound for administrative and maintenance calls (tenants, tokens, audit, GC, key
    #: rotation and retirement, purges, capacity, info), which then raise CacheUnavailableError.
    index_admin_timeout: float = 30.0
    #: How long a shredding (tenant deletion, key retirement) keeps trying to remove the
    #: destroyed keys from the index's files (SQLite's write-ahead log; PostgreSQL's dead
    #: tuples) before it reports the scrub incomplete and leaves it to the next GC run.
    scrub_timeout: float = 2.0
    #: The audit log's anchor file: signed checkpoints kept outside the database, so that a
    #: database-only attacker cannot rewind or rewrite audit chains (docs/audit.md). Default
    #: ``<root>/audit-anchors.jsonl``, beside the default key file; put it where the database's
    #: administrators cannot write.
    audit_anchor_path: Path | None = None
    #: Label data-plane metrics with the tenant's name. Off by default: whoever reads the
    #: metrics then learns every tenant's name and usage (docs/architecture.md, Metrics).
    metrics_tenant_labels: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        for name in ("audit_anchor_path", "cpu_claim_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        try:
            object.__setattr__(self, "suite", CipherSuite.parse(self.suite))
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
        for name in ("staging_bytes", "staging_slot_bytes", "layer_pool_bytes"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("default_quota_bytes", self.default_quota_bytes)
        for name in _AUTO_INTS:  # "auto" (a configuration file's spelling): derived
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().lower() == "auto":
                object.__setattr__(self, name, None)
        for name in ("lookup_cache_keys", "recent_writes_bytes"):
            value = getattr(self, name)
            if name == "recent_writes_bytes" and value is None:
                continue  # derived from the memory available
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be a non-negative integer, got {value!r}")
        if self.recent_writes_tenant_bytes is not None:
            _check_positive_int("recent_writes_tenant_bytes", self.recent_writes_tenant_bytes)
        for name in ("seal_workers", "load_workers", "window"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        for name in ("pin_workers", "hold_workers_for_first_layer"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("map_reads", "direct_writes"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be True, False or None, got {value!r}")
        if self.staging_bytes < self.staging_slot_bytes:
            raise InvalidRequestError("staging_bytes must hold at least one staging slot")
        _check_positive_number("lease_seconds", self.lease_seconds, maximum=MAX_SECONDS)
        _check_positive_number("hit_cost", self.hit_cost, maximum=1.0)
        for name in ("orphan_grace", "scrub_timeout"):
            _check_positive_number(name, getattr(self, name), maximum=MAX_SECONDS, allow_zero=True)
        for name in ("index_serving_timeout", "index_admin_timeout"):
            _check_positive_number(name, getattr(self, name), maximum=MAX_SECONDS)
        if self.gc_interval is not None:
            _check_positive_number("gc_interval", self.gc_interval, maximum=MAX_SECONDS)
        if self.database_url is not None:
            _check_database_url(self.database_url)
        if self.block_store_url is not None:
            try:  # refuse an unsupported URL early, before anything is opened
                check_block_store_url(self.block_store_url)
            except BlockStoreUrlError as err:
                raise InvalidRequestError(f"block_store_url: {err}") from None

    @property
    def index_url(self) -> str:
        return self.database_url or default_database_url(self.root)

    @property
    def anchor_file(self) -> Path:
        return self.audit_anchor_path or self.root / "audit-anchors.jsonl"

    @property
    def blocks_url(self) -> str:
        return self.block_store_url or default_block_store_url(self.root)

    @property
    def cores(self) -> int:
        """The CPUs this process can keep busy: its affinity mask bounded by its cgroup CPU
        quota (``tenantkv.host_cpus``), not the host's count, which inside a container or under
        ``taskset`` started more threads than the process had CPUs."""
        return host_cpus.usable_cpu_count()

    @property
    def seal_threads(self) -> int:
        return self.seal_workers or self.cores

    @property
    def load_threads(self) -> int:
        return self.load_workers or max(2, self.seal_threads)

    @property
    def read_ahead(self) -> int:
        return self.window or max(2, self.seal_threads)

    def with_overrides(self, **overrides: Any) -> CacheConfig:
        """A copy with ``overrides`` applied; unknown names are an InvalidRequestError."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidRequestError(f"unknown cache settings: {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        config_file: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> CacheConfig:
        """A config from the ``[cache]`` table of the configuration file (``config_file``, else
        the file ``TENANTKV_CONFIG`` names, if any), then ``TENANTKV_<FIELD>`` variables
        (``TENANTKV_ROOT``, ``TENANTKV_DATABASE_URL``, ``TENANTKV_BLOCK_STORE_URL``,
        ``TENANTKV_LOAD_WORKERS``, ...), then ``overrides``: overrides > environment > file >
        defaults. A ``TENANTKV_*`` variable no component reads is refused
        (:func:`check_environment`): a misspelt one would leave a fleet node on its own SQLite
        index. The master key is not read here: its provider reads ``TENANTKV_MASTER_KEY``
        itself."""
        env = os.environ if environ is None else environ
        check_environment(env)
        path = config_file or env.get(CONFIG_ENV) or None
        if path is None:
            return cls._from_sources(env, {}, overrides)
        settings = SettingsFile.read(path)
        settings.check_sections()
        spec = dataclasses.replace(
            CACHE_SECTION, build=lambda values, e: cls._from_sources(e, values, overrides)
        )
        config: CacheConfig = settings.build(spec, env)
        return config

    @classmethod
    def _from_sources(
        cls, env: Mapping[str, str], file_values: Mapping[str, Any], overrides: Mapping[str, Any]
    ) -> CacheConfig:
        values: dict[str, Any] = dict(file_values)
        for field in dataclasses.fields(cls):
            if field.name == "master_key":
                continue
            raw = env.get(ENV_PREFIX + field.name.upper())
            if raw is None or raw == "":
                continue
            values[field.name] = _parse_env(field.name, raw)
        values.update(overrides)
        return cls(**values)


#: The configuration file's ``[cache]`` table: every field but the master key (an object; the
#: key itself belongs in ``TENANTKV_MASTER_KEY``, a key file or a KMS, never in this file).
CACHE_SECTION = Section(
    "cache",
    CacheConfig,
    exclude=frozenset({"master_key"}),
    build=lambda values, env: CacheConfig._from_sources(env, values, {}),
)


class UnknownEnvironmentError(InvalidRequestError):
    """A ``TENANTKV_*`` environment variable that no component reads (a misspelling)."""


#: The admin server's variables (``tenantkv.server.settings.Settings``; a test keeps the two
#: in step), besides ``TENANTKV_ROOT``, which the cache owns.
SERVER_ENV_FIELDS = frozenset(
    {
        "host",
        "port",
        "log_level",
        "log_format",
        "log_tenants",
        "metrics_public",
        "max_token_ttl_seconds",
        "default_token_ttl_seconds",
        "max_body_bytes",
        "refusal_window_seconds",
        "refusal_max_sources",
    }
)
#: Variables of the project's own test and packaging scripts (scripts/, tests/).
TOOLING_ENV = frozenset(
    {
        "TENANTKV_TEST_POSTGRES_URL",
        "TENANTKV_TEST_REDIS_URL",
        "TENANTKV_TEST_OTHER_KEY",
        "TENANTKV_SKIP_ENGINES",
        "TENANTKV_SKIP_PEERS",
        "TENANTKV_SKIP_PACKAGE_CHECK",
        "TENANTKV_SKIP_GPU_CHECK",
        "TENANTKV_GPU_CHECK_INDEX",
        "TENANTKV_GPU_CHECK_TOKENS",
        "TENANTKV_FUZZ_EXAMPLES",
        "TENANTKV_QUICKSTART_POSTGRES",
        "TENANTKV_PKGCHECK_POSTGRES",
        "TENANTKV_PKGCHECK_REQUIRE_POSTGRES",
    }
)


def known_environment() -> frozenset[str]:
    """Every ``TENANTKV_*`` variable some component reads: the allow-list. A component that
    reads new ones adds them here."""
    cache = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(CacheConfig) if f.init}
    server = {ENV_PREFIX + name.upper() for name in SERVER_ENV_FIELDS}
    return frozenset(cache | server | TOOLING_ENV | {CONFIG_ENV, crypto.MASTER_KEY_ENV})


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a ``TENANTKV_*`` variable no component reads.

    Refusing rather than warning: a misspelt ``TENANTKV_DATABSE_URL`` left a fleet node on its
    own SQLite index under its root, serving and storing apart from the fleet, with nothing but
    a log line to say so; a node that fails to start is noticed at once."""
    env = os.environ if environ is None else environ
    known = known_environment()
    unknown = sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known)
    if unknown:
        import difflib

        hints = []
        for name in unknown:
            match = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name} (did you mean {match[0]}?)" if match else name)
        raise UnknownEnvironmentError(
            "unknown tenantkv environment variable"
            + ("s: " if len(unknown) > 1 else ": ")
            + ", ".join(hints)
            + " (unset it, or see docs/deploy.md for the names)"
        )


def open_key_wrapper(config: CacheConfig, *, create_key_file: bool = True) -> KeyWrapper:
    """The master key the config names (the key file under the root by default); a key that
    is missing or unreadable is a MasterKeyError.

    ``create_key_file=False`` where the index already exists: a key file made now could never
    open it (its key check was wrapped by the old key), so a missing file is an error rather
    than a fresh ``master.key`` left behind by a failed opening."""
    if isinstance(config.master_key, KeyWrapper):
        return config.master_key
    provider = config.master_key or default_master_key_provider(
        config.root / "master.key", create=create_key_file
    )
    try:
        return KeyEncryptionKey(provider.load())
    except crypto.MasterKeyError as err:
        if isinstance(err, MasterKeyError):
            raise
        raise MasterKeyError(str(err)) from err


def open_blocks(config: CacheConfig) -> BlockStore:
    """The block store ``config.blocks_url`` names; a URL no backend can serve (an unknown
    scheme, a missing optional package) is an InvalidRequestError."""
    try:
        return open_block_store(
            config.blocks_url,
            durable=config.durable,
            map_reads=config.map_reads,
            direct_writes=config.direct_writes,
            recent_writes_bytes=config.recent_writes_bytes,
            recent_writes_tenant_bytes=config.recent_writes_tenant_bytes,
        )
    except BlockStoreUrlError as err:
        raise InvalidRequestError(f"block_store_url: {err}") from None


_INTS = {
    "seal_workers",
    "load_workers",
    "window",
    "staging_bytes",
    "staging_slot_bytes",
    "layer_pool_bytes",
    "default_quota_bytes",
    "lookup_cache_keys",
    "recent_writes_bytes",
    "recent_writes_tenant_bytes",
}
#: Integers whose default (None) is derived, spelled ``auto`` in the environment.
_AUTO_INTS = {"recent_writes_bytes", "recent_writes_tenant_bytes"}
_FLOATS = {
    "hit_cost",
    "gc_interval",
    "orphan_grace",
    "lease_seconds",
    "scrub_timeout",
    "index_serving_timeout",
    "index_admin_timeout",
}
_BOOLS = {
    "durable",
    "map_reads",
    "direct_writes",
    "strict",
    "metrics_tenant_labels",
    "pin_workers",
    "hold_workers_for_first_layer",
}


def _parse_env(name: str, raw: str) -> Any:
    try:
        if name in _AUTO_INTS and raw.strip().lower() == "auto":
            return None
        if name in _INTS:
            return int(raw)
        if name in _FLOATS:
            return float(raw)
    except ValueError:
        raise InvalidRequestError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
    if name in _BOOLS:
        lowered = raw.strip().lower()
        if lowered not in ("1", "0", "true", "false", "yes", "no"):
            raise InvalidRequestError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean")
        return lowered in ("1", "true", "yes")
    return raw


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")


def _check_positive_number(
    name: str, value: Any, *, maximum: float, allow_zero: bool = False
) -> None:
    """A finite number in (0, ``maximum``] (or [0, ...]). NaN compares false with everything,
    so ``value < 0`` alone let a NaN through, and every later comparison with it is false too
    (a deadline that never comes, or one always past); infinity overflows the timeouts it
    becomes (``threading``'s waits refuse more than ``threading.TIMEOUT_MAX``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        least = "non-negative" if allow_zero else "positive"
        raise InvalidRequestError(f"{name} must be a finite {least} number, got {value!r}")
    if value > maximum:
        raise InvalidRequestError(f"{name} must be at most {maximum:g}, got {value!r}")


def default_root() -> str:
    """The root the CLI and the admin service use when none is given: ``TENANTKV_ROOT``, else
    the ``root`` of the configuration file ``TENANTKV_CONFIG`` names, else
    ``./tenantkv-data``."""
    from_env = os.environ.get(ENV_PREFIX + "ROOT")
    if from_env:
        return from_env
    path = os.environ.get(CONFIG_ENV)
    if path:
        settings = SettingsFile.read(path)
        root = settings.table(CACHE_SECTION).get("root")
        if root:
            return str(root)
    return DEFAULT_ROOT


def config_for_root(root: str | os.PathLike[str]) -> CacheConfig:
    """What the CLI and the admin service open: ``root``, with every other setting from the
    configuration file ``TENANTKV_CONFIG`` names and the ``TENANTKV_*`` environment (so one
    deployment's settings reach every entry point)."""
    return CacheConfig.from_env(root=Path(root))
