"""What opening a cache checks and prepares in the index, once, before anything is served."""

from __future__ import annotations

from ..components.context import CacheContext
from ..crypto import KeyWrapper, new_key
from ..index import migrate, settings
from .capacity import init_capacity
from .schema_upgrade import KEY_CHECK_CONTEXT, upgrade_command, verify_master_key


def prepare_index(ctx: CacheContext, wrapper: KeyWrapper) -> None:
    """Create a fresh index's tables (or refuse one at another schema revision: see
    ``index/migrate.py``), check the master key, prepare the audit log's signing key and the
    initial capacity, and read the key epoch.

    The admin API's token table is made here too, not only when the server starts: deleting a
    tenant revokes its tokens in the deletion's own transaction, on every path (Python, CLI,
    HTTP)."""
    # Nodes starting together on one index check or create its settings one after another.
    with ctx.index.opening():
        migrate.ensure_current(ctx.index, upgrade_command(ctx.config))
        check_master_key(ctx, wrapper)
        with ctx.index.write() as session:
            ctx.audit.prepare(session)
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
            blob = wrapper.wrap(new_key(), KEY_CHECK_CONTEXT)
            settings.put(session, settings.MASTER_KEY_CHECK, blob.hex())
            return
    verify_master_key(stored, wrapper)
