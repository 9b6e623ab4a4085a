"""Making crypto-shredding final in the index's files, or saying plainly that it is not yet.

Destroying a tenant's wrapped keys in a committed transaction makes them unreachable through the
index, but not yet gone from disk: SQLite keeps the old page images in its write-ahead log until
a checkpoint may truncate it, which another connection's open read snapshot prevents; PostgreSQL
keeps dead tuples until VACUUM may remove them, which an older running transaction prevents. With
the master key, a surviving wrapped key decrypts a copied extent. So every shredding scrubs the
index (``Database.scrub_log``, retried for ``config.scrub_timeout``), and when that cannot
finish, the operator is told: a logged warning, the ``incomplete_scrubs`` health counter, the
``scrub_pending`` level (1 until a later scrub succeeds; the GC tick retries) and, for key
retirement, ``scrub_complete`` in its result.
"""

from __future__ import annotations

import logging

from sqlalchemy.exc import SQLAlchemyError

from ..components.context import CacheContext
from ..components.health import INCOMPLETE_SCRUBS, SCRUB_PENDING

logger = logging.getLogger("tenantkv")


def scrub_after_shredding(ctx: CacheContext, what: str) -> bool:
    """Scrub the index after ``what`` destroyed keys; return whether the scrub completed."""
    try:
        outcome = ctx.index.scrub_log(ctx.config.scrub_timeout)
    except SQLAlchemyError as err:
        complete, detail = False, f"the scrub failed: {err}"
    else:
        complete, detail = outcome.complete, outcome.detail
    if complete:
        ctx.health.set(SCRUB_PENDING, 0)
        return True
    ctx.health.count(INCOMPLETE_SCRUBS)
    ctx.health.set(SCRUB_PENDING, 1)
    logger.warning(
        "after %s, destroyed keys may remain in the index's files: %s; the next GC run "
        "tries again (health counter scrub_pending stays 1 until then)",
        what,
        detail,
    )
    return False


def retry_pending_scrub(ctx: CacheContext) -> bool | None:
    """On a GC run: retry a scrub that did not complete. Returns its outcome, or ``None`` when
    none was pending."""
    if not ctx.health.counts().get(SCRUB_PENDING):
        return None
    return scrub_after_shredding(ctx, "an earlier shredding")
