"""Where sealed extents live: the :class:`BlockStore` interface and its backends."""

from .base import BlockStore, ExtentReader, ExtentWriter
from .errors import ExtentNotFoundError, ShortReadError, StorageError
from .local import LocalBlockStore

__all__ = [
    "BlockStore",
    "ExtentNotFoundError",
    "ExtentReader",
    "ExtentWriter",
    "LocalBlockStore",
    "ShortReadError",
    "StorageError",
]
