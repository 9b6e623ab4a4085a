"""Whether the keys a running load reads with still exist, asked before every layer it hands over.

Deleting a tenant or retiring a key version makes its data unreadable at once; a load that was
already running must not go on delivering layers after that. Asking the index before every layer
would cost a query per layer, so the guard watches the keyring's revocation count instead (it
moves when this node deletes a tenant or retires keys, right after the commit, and when the
key-epoch watcher sees another node change keys, within its interval of about two seconds), and
only then asks the index whether the load's key versions are still there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from sqlalchemy.exc import SQLAlchemyError

from ..index import tenants as tenant_rows
from ..index.database import Database

logger = logging.getLogger("tenantkv")


class KeyGuard:
    """The data-key versions of one tenant that one load reads with."""

    def __init__(
        self,
        db: Database,
        revocations: Callable[[], int],
        tenant_id: bytes,
        versions: Collection[int],
        *,
        seen: int,
    ) -> None:
        """``revocations`` reads the keyring's count (``Keyring.revocations``); ``seen`` is its
        value before the load's plan was read, so a deletion committed in between is noticed."""
        self._db = db
        self._revocations = revocations
        self._tenant_id = tenant_id
        self._versions = sorted(set(versions))
        self._seen = seen

    def keys_exist(self) -> bool:
        """Whether every key version of the load still exists. Fails closed: an index that
        cannot answer after a revocation ends the load (a typed ``LoadError`` for the caller)."""
        current = self._revocations()
        if current == self._seen:
            return True
        try:
            with self._db.read(serving=True) as session:
                present = all(
                    tenant_rows.wrapped_data_key(session, self._tenant_id, version) is not None
                    for version in self._versions
                )
        except SQLAlchemyError as err:
            logger.warning("could not check a running load's keys (stopping it): %s", err)
            return False
        if present:
            self._seen = current
        return present
