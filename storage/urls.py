"""Block stores from URLs: the one place that knows which scheme means which backend.

* ``file:///abs/dir`` -- :class:`~.local.LocalBlockStore` (a local directory or a shared POSIX
  mount: NFS, CephFS, 3FS FUSE);
* ``redis://host:port/db?prefix=tkv:`` -- :class:`~.redis_store.RedisBlockStore` (also
  ``rediss://`` and ``unix:///path/redis.sock?db=0``; needs the ``redis`` extra);
* tiers separated by commas, hottest first -- :class:`~.tiered.TieredBlockStore`, e.g.
  ``redis://127.0.0.1:6379/0?prefix=tkv:,file:///mnt/kv``. The last tier is the durable one
  (it must be ``file://``); a comma inside a path is written ``%2C``.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from .base import BlockStore
from .errors import StorageError

REDIS_SCHEMES = ("redis", "rediss", "unix")


class BlockStoreUrlError(StorageError, ValueError):
    """A block-store URL that names no usable backend (unknown scheme, malformed, or a
    backend whose optional package is not installed)."""


def split_tiers(url: str) -> list[str]:
    """The tier URLs of ``url``, hottest first (one for a plain URL)."""
    tiers = [part.strip() for part in url.split(",")]
    if not url.strip() or any(not part for part in tiers):
        raise BlockStoreUrlError(f"block_store_url {url!r} has an empty tier")
    return tiers


def file_path(url: str) -> Path:
    """The directory of a ``file://`` URL (absolute, on this host)."""
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise BlockStoreUrlError(f"{url!r} is not a file:///absolute/path URL")
    path = Path(unquote(parsed.path))
    if not path.is_absolute():
        raise BlockStoreUrlError(f"{url!r} does not name an absolute path")
    return path


def check_block_store_url(url: str) -> None:
    """Refuse a malformed URL without connecting to anything or importing optional packages."""
    tiers = split_tiers(url)
    for tier in tiers:
        scheme = urlparse(tier).scheme
        if scheme == "file":
            file_path(tier)
        elif scheme in REDIS_SCHEMES:
            parsed = urlparse(tier)
            if scheme != "unix" and not parsed.hostname:
                raise BlockStoreUrlError(f"{tier!r} names no host")
            if scheme == "unix" and not parsed.path:
                raise BlockStoreUrlError(f"{tier!r} names no socket path")
        else:
            raise BlockStoreUrlError(
                f"unsupported block store {tier!r}: use file:///absolute/path, "
                "redis://host:port/db?prefix=..., or tiers separated by commas, hottest first"
            )
    if len(tiers) > 1 and urlparse(tiers[-1]).scheme != "file":
        raise BlockStoreUrlError(
            f"the last tier of {url!r} must be a durable file:/// directory (hot tiers first)"
        )


def _open_tier(
    url: str,
    *,
    durable: bool,
    map_reads: bool | None,
    direct_writes: bool | None,
    recent_writes_bytes: int | None,
    recent_writes_tenant_bytes: int | None,
) -> BlockStore:
    if urlparse(url).scheme == "file":
        from .local import LocalBlockStore

        return LocalBlockStore(
            file_path(url),
            durable=durable,
            map_reads=map_reads,
            direct=direct_writes,
            recent_bytes=recent_writes_bytes,
            recent_owner_bytes=recent_writes_tenant_bytes,
        )
    try:
        from .redis_store import RedisBlockStore
    except ModuleNotFoundError as err:
        if err.name != "redis":
            raise
        raise BlockStoreUrlError(
            f"{url!r} needs the redis-py package: pip install 'tenantkv[redis]'"
        ) from None
    try:
        return RedisBlockStore.from_url(url)
    except ValueError as err:
        raise BlockStoreUrlError(f"bad Redis URL {url!r}: {err}") from None


def open_block_store(
    url: str,
    *,
    durable: bool = True,
    map_reads: bool | None = None,
    direct_writes: bool | None = None,
    recent_writes_bytes: int | None = 0,
    recent_writes_tenant_bytes: int | None = None,
) -> BlockStore:
    """The store ``url`` names. Nothing connects yet: Redis connects on first use.
    ``recent_writes_bytes``: the ring of recently written extents of a directory written with
    ``O_DIRECT`` (``recent_owners.py``; None: derived from the memory available), one ring
    per tenant of ``recent_writes_tenant_bytes`` (None: derived from the whole)."""
    check_block_store_url(url)
    tiers = split_tiers(url)
    stores: list[BlockStore] = []
    try:
        for tier in tiers:
            stores.append(
                _open_tier(
                    tier,
                    durable=durable,
                    map_reads=map_reads,
                    direct_writes=direct_writes,
                    recent_writes_bytes=recent_writes_bytes,
                    recent_writes_tenant_bytes=recent_writes_tenant_bytes,
                )
            )
    except BaseException:
        for store in stores:
            store.close()
        raise
    if len(stores) == 1:
        return stores[0]
    from .tiered import TieredBlockStore

    return TieredBlockStore(stores)
