"""What opening a cache checks and prepares in the index, once, before anything is served."""

from __future__ import annotations

from ..context import CacheContext
from ..crypto import KeyWrapper, SealOpenError, new_key
from ..errors import MasterKeyError
from ..index import api_tokens, settings
from .capacity import init_capacity

_KEY_CHECK_CONTEXT = b"tenantkv/master-key-check"


def prepare_index(ctx: CacheContext, wrapper: KeyWrapper) -> None:
    """Create the schema, check the master key, prepare the audit log (signing key, MAC
    columns of an older index) and the initial capacity, and read the key epoch.

    The admin API's token table is made (or brought up to date) here too, not only when the
    server starts: deleting a tenant revokes its tokens in the deletion's own transaction, on
    every path (Python, CLI, HTTP)."""
    # Nodes starting together on one index check or create its settings one after another.
    with ctx.index.opening():
        ctx.index.create_schema()
        api_tokens.ensure_table(ctx.index)
        check_master_key(ctx, wrapper)
        with ctx.index.write() as session:
            ctx.audit.prepare(session)  # also upgrades an older index's audit tables
        init_capacity(ctx)
    ctx.key_epoch.check()


def check_master_key(ctx: CacheContext, wrapper: KeyWrapper) -> None:
    """Refuse a master key that is not the one this index was created with.

    The index keeps a random value wrapped by its master key; a wrong key (a lost or swapped
    key file, a wrong environment variable) fails here with a clear error instead of at the
    first namespace.
    """
    with ctx.index.write() as session:
        stored = settings.get(session, settings.MASTER_KEY_CHECK)
        if stored is None:
            blob = wrapper.wrap(new_key(), _KEY_CHECK_CONTEXT)
            settings.put(session, settings.MASTER_KEY_CHECK, blob.hex())
            return
    try:
        wrapper.unwrap(bytes.fromhex(stored), _KEY_CHECK_CONTEXT)
    except SealOpenError:
        raise MasterKeyError("the master key does not open this cache's index") from None
