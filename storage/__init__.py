"""Where sealed extents live: the :class:`BlockStore` interface and its backends.

:func:`open_block_store` builds one from a URL (``file://``, ``redis://``, or tiers separated by
commas). The Redis backend needs the ``redis`` extra and is imported only when a URL names it.
"""

from .base import BlockStore, ExtentReader, ExtentWriter, StoreCapabilities
from .errors import ExtentNotFoundError, ShortReadError, StorageError
from .local import LocalBlockStore
from .tiered import TieredBlockStore
from .urls import BlockStoreUrlError, check_block_store_url, open_block_store

__all__ = [
    "BlockStore",
    "BlockStoreUrlError",
    "ExtentNotFoundError",
    "ExtentReader",
    "ExtentWriter",
    "LocalBlockStore",
    "ShortReadError",
    "StorageError",
    "StoreCapabilities",
    "TieredBlockStore",
    "check_block_store_url",
    "open_block_store",
]
