"""The second half of the one delete path: an extent's bytes, after its rows are gone.

Callers delete extent rows with :func:`tenantkv.index.extents.delete_rows` inside their write
transaction and hand the ids here after it commits. Bytes of an extent that some node's load
still holds a lease on are kept; the load that releases the last lease removes them (and the
orphan sweep does, should that node die first). Failures to delete are left to the sweep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from sqlalchemy.orm import Session

from ..index import extents, leases
from ..index.database import Database
from ..index.quota import lock_tenants
from ..storage import BlockStore, StorageError

logger = logging.getLogger("tenantkv")


class ExtentRemover:
    """Removes the bytes of extents whose index rows were deleted, honouring every lease."""

    def __init__(
        self, db: Database, blocks: BlockStore, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._db = db
        self._blocks = blocks
        self._wall_clock = wall_clock
        #: Which of the given extents a load holds: lease rows of every node, and (once the
        #: node's lease keeper sets it to ``LeaseKeeper.held``) this node's unwritten leases.
        self.held: Callable[[Session, Collection[str]], set[str]] = lambda session, ids: (
            leases.leased(session, ids, self._wall_clock())
        )

    def remove_bytes(self, extent_ids: Collection[str]) -> int:
        """Delete the bytes of ``extent_ids`` that no live lease holds; return how many went."""
        if not extent_ids:
            return 0
        with self._db.read() as session:
            held = self.held(session, extent_ids)
        removed = 0
        for extent_id in extent_ids:
            if extent_id in held:
                continue  # a load on some node reads it; the last lease's release removes it
            removed += self.delete_file(extent_id)
        return removed

    def drop_now(self, extent_id: str) -> None:
        """Remove a damaged or lost extent from the index (first) and the store (second).

        Its bytes go at once even if loads hold leases on them: they fail to open for every
        reader alike, so there is nothing left to protect."""
        with self._db.write() as session:
            tenant_id = extents.tenant_of(session, extent_id)
            if tenant_id is not None:  # its tenant's row first, like every change to its extents
                lock_tenants(session, [tenant_id])
            extents.delete_rows(session, [extent_id])
        self.delete_file(extent_id)

    def delete_file(self, extent_id: str) -> bool:
        try:
            return self._blocks.delete(extent_id)
        except StorageError as err:
            logger.warning(
                "could not delete extent %s (left for the orphan sweep): %s", extent_id, err
            )
            return False
