"""Error types of the block store."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every ``tenantkv.storage`` error: bytes could not be had or kept."""


class ExtentNotFoundError(StorageError):
    """No committed extent has this id (never written, deleted, or lost)."""


class ShortReadError(StorageError):
    """A range read ended before the requested bytes (the extent is shorter than it should be)."""
