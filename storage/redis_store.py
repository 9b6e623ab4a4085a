r"""Redis / Valkey block store: a shared hot tier that every node reaches over the network.

Keys and values (nothing else is written)::

    <prefix><id>          the extent's store header: commit time and size (ASCII decimals)
    <prefix><id>:<n>      bytes [n * chunk_bytes, (n + 1) * chunk_bytes) of the extent
    <prefix>tmp:<id>...   the same keys of an extent being written (expire by themselves)

``<id>`` is the store's random id (32 hex digits), never derived from tokens. Chunk values are
the extent's bytes exactly as the cache sealed them: ciphertext with its own header. The store
header exists because Redis keeps no modification times and because an extent spans several
keys (a Redis string holds at most ``proto-max-bulk-len``, 512 MiB by default, and an
8,192-token DeepSeek-V3 prefix is 576 MB); it says nothing about tokens or tenants. The server
never sees plaintext, keys or tenant names.

Atomic publish: a writer creates its temporary header key with a TTL, fills temporary chunk
keys with ``SETRANGE`` (several threads may write disjoint ranges at once), and :meth:`commit`
stamps the header and ``RENAME``\ s every temporary key to its final name, setting the final
TTL, in one Lua script, which Redis runs atomically. A reader therefore sees no extent or all
of it; a writer that crashes leaves only temporary keys, which expire ``temp_ttl`` seconds
after its last write. Each write runs as a script that writes only while the writer's header
key lives (a plain ``SETRANGE`` would recreate an expired key without a TTL).

Redis evicts on its own (``maxmemory`` policies, TTLs) and, as deployed here, keeps nothing on
disk: the store declares ``evicts_on_its_own`` and not ``durable``, so the cache treats a
missing key as a *lost* extent (a miss and a health counter), never as tampering; an evicted
chunk shows as a short extent, which is the same. Listing is a ``SCAN`` over the whole key
space, so the store does not claim cheap listing: GC's orphan sweep skips it, and orphans
expire through the TTL every commit sets.

TTLs: one fixed ``ttl`` for every extent of the store, set at commit and restarted by
:meth:`RedisBlockStore.retain` (a load's use), whatever ``retain_for`` or ``seconds`` the
cache passes. Why not the extent's retention, as the cache asks: a TTL is readable by anyone
who can read the keys (``PTTL``; a Redis operator, a replica, a ``MONITOR``), and a TTL equal to
the retention of the extent's class sorts the extents by tenant, since tenants choose their
classes (a tenant whose chat class is 9 days owns every extent whose TTL started at 9 days). A
fixed TTL tells such a reader only when each extent was last stored or used, which the header's
commit time and the traffic show anyway. Quantised or jittered TTLs would only blur the
grouping, and with enough extents a class shows through the noise. Retention is not Redis'
job: the index is authoritative (an extent past its expiry is a miss, whatever the store still
holds, and GC deletes its keys), and in a tiered store the directory holds every extent. The
default, :data:`DEFAULT_TTL`, outlasts the longest retention a tenant may be given, so a store
used alone never forgets an extent the index still serves; a shorter ``ttl=`` (a hot tier in
front of a directory, where Redis is a cache) makes extents idle for longer than it hot-tier
misses, and, for a store used alone, lost extents (misses) before their retention ends.
``ttl=0`` sets none: keys stay until GC deletes them or ``maxmemory`` evicts them, and orphans
of crashed nodes stay too (the store then no longer claims ``expires``).

Not for Redis Cluster: an extent's keys must share one hash slot for the script.

Every Redis failure (refused or killed connection, timeout, error reply) is raised as
:class:`~.errors.StorageError`, which the cache degrades on; redis-py's connection pool
reconnects by itself once the server answers again.
"""

from __future__ import annotations

import contextlib
import math
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry
from typing_extensions import Buffer

from .base import BlockStore, ExtentReader, ExtentWriter, StoreCapabilities
from .errors import ExtentNotFoundError, ShortReadError, StorageError

DEFAULT_PREFIX = "tenantkv:"
#: Every committed extent's TTL (seconds after its last store or use): 366 days, the longest
#: retention a tenant may be given (``tenantkv.retention.MAX_RETENTION``; a test checks they
#: agree), so that by default the TTL never ends an extent before the index does.
DEFAULT_TTL = 366 * 86400.0
#: How long temporary keys outlive their writer's last write.
DEFAULT_TEMP_TTL = 600.0
#: Bytes per chunk key: well under Redis' 512 MiB string limit, large enough that a layer's
#: range read touches one or two keys.
DEFAULT_CHUNK_BYTES = 64 * 2**20
#: Bytes per ``GETRANGE`` of a read: a range is fetched as pipelined pieces of this size, since
#: one multi-megabyte reply costs the client far more per byte to receive and parse than a few
#: smaller ones (bench/tiers.py measures the tier).
READ_PIECE_BYTES = 2**20
_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
_TEMP = "tmp:"
_FIELD = 20  # digits of each header field
_EMPTY_HEADER = b"0" * (2 * _FIELD)
# Redis' default socket settings wait forever; a cache must give up quickly and serve a miss.
_CONNECTION_DEFAULTS = {"socket_connect_timeout": 2.0, "socket_timeout": 10.0}

# KEYS[1] temporary header, KEYS[2] temporary chunk; ARGV offset, data, temp TTL (ms).
# 0 if the writer's header key has expired.
_WRITE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SETRANGE', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
# KEYS[1] temporary header, KEYS[2] final header, then pairs (temporary chunk, final chunk);
# ARGV header, TTL in ms (0: none). 0 if the writer's header key or a chunk has expired.
_COMMIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 3, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
for i = 1, #KEYS, 2 do
  redis.call('RENAME', KEYS[i], KEYS[i + 1])
  if tonumber(ARGV[2]) > 0 then
    redis.call('PEXPIRE', KEYS[i + 1], ARGV[2])
  else
    redis.call('PERSIST', KEYS[i + 1])
  end
end
return 1
"""
# KEYS[1] header; ARGV[1] chunk bytes. Deletes the header and every chunk it names.
_DELETE = """
local header = redis.call('GET', KEYS[1])
if not header then return 0 end
local size = tonumber(string.sub(header, 21, 40))
local chunks = math.ceil(size / tonumber(ARGV[1]))
for n = 0, chunks - 1 do redis.call('DEL', KEYS[1] .. ':' .. n) end
redis.call('DEL', KEYS[1])
return 1
"""
# KEYS[1] header; ARGV TTL (ms), chunk bytes. Extends (never shortens) the extent's keys' TTL.
_RETAIN = """
local header = redis.call('GET', KEYS[1])
if not header then return 0 end
local size = tonumber(string.sub(header, 21, 40))
local chunks = math.ceil(size / tonumber(ARGV[2]))
for n = 0, chunks - 1 do
  local key = KEYS[1] .. ':' .. n
  local ttl = redis.call('PTTL', key)
  if ttl >= 0 and ttl < tonumber(ARGV[1]) then redis.call('PEXPIRE', key, ARGV[1]) end
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 and ttl < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""


def _header(modified_us: int, size: int) -> bytes:
    return f"{modified_us:0{_FIELD}d}{size:0{_FIELD}d}".encode()


def _bytes(value: object) -> bytes:
    """A reply of the client, which is never told to decode responses."""
    if not isinstance(value, bytes):
        raise StorageError(f"unexpected reply from Redis: {type(value).__name__}")
    return value


def _parse_header(raw: object) -> tuple[int, int] | None:
    if not isinstance(raw, bytes) or len(raw) != 2 * _FIELD or not raw.isdigit():
        return None
    return int(raw[:_FIELD]), int(raw[_FIELD:])


@contextlib.contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    """Turn redis-py's errors into the storage error the cache degrades on."""
    try:
        yield
    except RedisError as err:
        raise StorageError(f"{what} failed: {type(err).__name__}: {err}") from err


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _milliseconds(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def parse_redis_url(url: str) -> tuple[str, str, float]:
    """Split a block-store URL into (redis-py URL, key prefix, TTL in seconds): ``?prefix=``
    and ``?ttl=`` (seconds; 0 for none) are ours, every other query parameter is redis-py's
    (``socket_timeout=``, ``ssl_cert_reqs=``, ...)."""
    parsed = urlparse(url)
    query = parse_qsl(parsed.query, keep_blank_values=True)
    ours = ("prefix", "ttl")
    given = {name: [value for key, value in query if key == name] for name in ours}
    rest = [(name, value) for name, value in query if name not in ours]
    for name, values in given.items():
        if len(values) > 1:
            raise ValueError(f"{url!r} gives {name}= more than once")
    prefix = given["prefix"][0] if given["prefix"] else DEFAULT_PREFIX
    ttl = _check_ttl(given["ttl"][0]) if given["ttl"] else DEFAULT_TTL
    return urlunparse(parsed._replace(query=urlencode(rest))), prefix, ttl


def _check_ttl(value: str | float) -> float:
    """A TTL in seconds: a finite number, at least 0 (0: none)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"ttl={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"ttl={value!r} must be a finite number of seconds, 0 for none")
    return seconds


def _spans(
    offset: int, length: int, chunk: int, piece: int | None = None
) -> Iterator[tuple[int, int, int, int]]:
    """(chunk number, offset in the chunk, offset in the data, length) of each piece of the
    byte range ``[offset, offset + length)``: pieces never cross a chunk and hold at most
    ``piece`` bytes (no limit when ``None``)."""
    done = 0
    while done < length:
        number, inner = divmod(offset + done, chunk)
        part = min(chunk - inner, length - done, piece or length)
        yield number, inner, done, part
        done += part


def _scatter(parts: Iterable[bytes], views: Sequence[memoryview]) -> None:
    """Copy consecutive ``parts`` into consecutive ``views`` once, without joining them."""
    targets = iter(views)
    target = next(targets)
    filled = 0
    for part in parts:
        source = memoryview(part)
        while source:
            while filled == len(target):
                target, filled = next(targets), 0
            step = min(len(source), len(target) - filled)
            target[filled : filled + step] = source[:step]
            source = source[step:]
            filled += step


class _RedisWriter(ExtentWriter):
    def __init__(self, store: RedisBlockStore, extent_id: str) -> None:
        self._store = store
        self._id = extent_id
        self._temp = store.temp_key(extent_id)
        self._done = False
        self._end = 0  # the extent's size so far: the end of the furthest region written
        self._lock = threading.Lock()
        with _redis_errors("creating extent"):
            created = store.client.set(
                self._temp, _EMPTY_HEADER, px=_milliseconds(store.temp_ttl), nx=True
            )
        if not created:
            raise StorageError(f"extent {extent_id} is already being written")

    def write(self, data: Buffer) -> None:
        with self._lock:
            offset = self._end
        self.write_at(offset, data)

    def write_at(self, offset: int, data: Buffer) -> None:
        if self._done:
            raise StorageError("extent writer is closed")
        view = memoryview(data).cast("B")
        ttl = _milliseconds(self._store.temp_ttl)
        try:
            for number, inner, start, length in _spans(offset, len(view), self._store.chunk_bytes):
                with _redis_errors("writing extent"):
                    ok = self._store.write_script(
                        keys=[self._temp, f"{self._temp}:{number}"],
                        args=[inner, view[start : start + length].tobytes(), ttl],
                    )
                if not ok:
                    raise StorageError("extent writer's temporary keys expired (writer too slow)")
        except StorageError:
            self.abort()
            raise
        if view:
            with self._lock:
                self._end = max(self._end, offset + len(view))

    def commit(self, *, retain_for: float | None = None) -> str:
        if self._done:
            raise StorageError("extent writer is closed")
        size = self._end
        final = self._store.key(self._id)
        keys = [self._temp, final]
        for number in range(-(-size // self._store.chunk_bytes)):
            keys += [f"{self._temp}:{number}", f"{final}:{number}"]
        header = _header(int(time.time() * 1_000_000), size)
        # The store's one TTL, never ``retain_for``: see "TTLs" in the module docstring.
        ttl = self._store.ttl_ms
        try:
            with _redis_errors("committing extent"):
                ok = self._store.commit_script(keys=keys, args=[header, ttl])
            if not ok:
                raise StorageError("extent writer's temporary keys expired before the commit")
        except StorageError:
            self.abort()
            raise
        self._done = True
        return self._id

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        chunks = -(-self._end // self._store.chunk_bytes)
        # Best effort: temporary keys left behind expire by themselves.
        with contextlib.suppress(RedisError):
            self._store.client.delete(self._temp, *(f"{self._temp}:{n}" for n in range(chunks)))


class _RedisReader(ExtentReader):
    def __init__(self, store: RedisBlockStore, extent_id: str) -> None:
        self._store: RedisBlockStore | None = store
        self._key = store.key(extent_id)
        with _redis_errors("opening extent"):
            header = _parse_header(store.client.get(self._key))
        if header is None:  # never written, deleted or evicted
            raise ExtentNotFoundError(f"no extent {extent_id}")
        self._size = header[1]

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, offset: int, buffers: Sequence[Buffer]) -> None:
        store = self._store
        if store is None:
            raise StorageError("extent reader is closed")
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        if wanted == 0:
            return
        if offset + wanted > self._size:
            raise ShortReadError(
                f"extent ends at byte {self._size}, wanted up to {offset + wanted}"
            )
        spans = list(_spans(offset, wanted, store.chunk_bytes, store.read_piece_bytes))
        with _redis_errors("reading extent"):
            if len(spans) == 1:
                number, inner, _, length = spans[0]
                parts = [
                    _bytes(
                        store.client.getrange(f"{self._key}:{number}", inner, inner + length - 1)
                    )
                ]
            else:
                pipe = store.client.pipeline(transaction=False)
                for number, inner, _, length in spans:
                    pipe.getrange(f"{self._key}:{number}", inner, inner + length - 1)
                parts = [_bytes(part) for part in pipe.execute()]
        for (_, _, _, length), part in zip(spans, parts, strict=True):
            if len(part) != length:  # a chunk was evicted since the extent was opened
                raise ShortReadError(f"extent {self._key} lost a chunk (evicted?)")
        _scatter(parts, [view for view in views if view])

    def close(self) -> None:
        self._store = None


class RedisBlockStore(BlockStore):
    """Extents as Redis (or Valkey) strings under ``prefix``; see the module docstring.

    ``client`` is any ``redis.Redis`` (it owns a connection pool and is thread-safe);
    :meth:`from_url` builds one from a ``redis://``, ``rediss://`` or ``unix://`` URL.
    Redis' own persistence settings decide what survives its restart, so the store never
    claims durability. ``ttl`` (seconds, 0 for none) is every extent's TTL after its last
    store or use, whatever retention the cache asks for ("TTLs" in the module docstring).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        temp_ttl: float = DEFAULT_TEMP_TTL,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        read_piece_bytes: int = READ_PIECE_BYTES,
        ttl: float = DEFAULT_TTL,
    ) -> None:
        if not prefix:
            raise ValueError("a Redis block store needs a non-empty key prefix")
        if chunk_bytes <= 0 or read_piece_bytes <= 0:
            raise ValueError("chunk_bytes and read_piece_bytes must be positive")
        self.client = client
        self.prefix = prefix
        self.temp_ttl = temp_ttl
        self.ttl = _check_ttl(ttl)
        #: The TTL in milliseconds as the scripts take it (0: none).
        self.ttl_ms = _milliseconds(self.ttl) if self.ttl > 0 else 0
        self.chunk_bytes = chunk_bytes
        self.read_piece_bytes = read_piece_bytes
        self.write_script = client.register_script(_WRITE)
        self.commit_script = client.register_script(_COMMIT)
        self._delete_script = client.register_script(_DELETE)
        self._retain_script = client.register_script(_RETAIN)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBlockStore:
        """A store from ``redis://host:port/db?prefix=...&ttl=...`` (``rediss://``, ``unix://``
        too). A ``ttl`` passed in ``options`` wins over the URL's."""
        client_url, prefix, ttl = parse_redis_url(url)
        options.setdefault("ttl", ttl)
        query = dict(parse_qsl(urlparse(client_url).query))
        defaults: dict[str, Any] = {
            name: value for name, value in _CONNECTION_DEFAULTS.items() if name not in query
        }
        # One immediate retry: a pooled connection that was killed (CLIENT KILL, a restart)
        # reconnects, while a server that is down fails fast instead of backing off for
        # seconds (redis-py's default) on a serving path that would rather miss.
        client = redis.Redis.from_url(client_url, retry=Retry(NoBackoff(), 1), **defaults)
        return cls(client, prefix=prefix, **options)

    @property
    def capabilities(self) -> StoreCapabilities:
        return StoreCapabilities(
            durable=False, evicts_on_its_own=True, cheap_listing=False, expires=self.ttl > 0
        )

    def key(self, extent_id: str) -> str:
        if not _ID_PATTERN.fullmatch(extent_id):
            raise ExtentNotFoundError(f"{extent_id!r} is not an extent id")
        return self.prefix + extent_id

    def temp_key(self, extent_id: str) -> str:
        return self.prefix + _TEMP + extent_id

    def create(self, owner: str = "") -> ExtentWriter:
        return _RedisWriter(self, secrets.token_hex(16))

    def create_as(self, extent_id: str, owner: str = "") -> ExtentWriter:
        self.key(extent_id)  # refuse a malformed id
        return _RedisWriter(self, extent_id)

    def open(self, extent_id: str) -> ExtentReader:
        return _RedisReader(self, extent_id)

    def delete(self, extent_id: str) -> bool:
        try:
            key = self.key(extent_id)
        except ExtentNotFoundError:
            return False
        with _redis_errors("deleting extent"):
            return bool(self._delete_script(keys=[key], args=[self.chunk_bytes]))

    def list(self) -> Iterator[str]:
        with _redis_errors("listing extents"):
            for raw in self.client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000):
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                extent_id = name[len(self.prefix) :]
                if _ID_PATTERN.fullmatch(extent_id):
                    yield extent_id

    def modified_at(self, extent_id: str) -> float:
        with _redis_errors("reading extent time"):
            header = _parse_header(self.client.get(self.key(extent_id)))
        if header is None:
            raise ExtentNotFoundError(f"no extent {extent_id}")
        return header[0] / 1_000_000

    def retain(self, extent_ids: Iterable[str], seconds: float) -> None:
        """Restart each extent's TTL: the store's ``ttl`` from now (never shortened), whatever
        ``seconds`` asks ("TTLs" in the module docstring). Nothing to do without a TTL."""
        keys = [self.prefix + i for i in extent_ids if _ID_PATTERN.fullmatch(i)]
        if not keys or not self.ttl_ms:
            return
        with _redis_errors("extending extent TTLs"):
            pipe = self.client.pipeline(transaction=False)  # one round trip for all
            for key in keys:
                self._retain_script(keys=[key], args=[self.ttl_ms, self.chunk_bytes], client=pipe)
            pipe.execute()

    def temporary(self) -> tuple[str, ...]:
        """Ids of extents being written (or left by crashed writers until their keys expire)."""
        with _redis_errors("listing temporary keys"):
            names = self.client.keys(_glob_escape(self.prefix + _TEMP) + "*")
        decoded = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        ids = (n[len(self.prefix) + len(_TEMP) :] for n in decoded)
        return tuple(i for i in ids if ":" not in i)

    def close(self) -> None:
        self.client.close()
