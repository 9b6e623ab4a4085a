"""Token identity and audit integrity (issue 13): the token table's ``tenant_id`` and
``minted_by``, the audit log's MAC columns and its purge statements.

Revision ID: identity_audit_macs
Revises: fleet_tables

The data migrations that tenantkv used to run at open live here now:

* ``minted_by`` is recovered from ``created_by`` (the admin API recorded ``token:<id>``);
  ``tenant_id`` is filled in only where the tenant of that name was created before the token
  (so the token was made for it, not for a deleted predecessor). Other tenant-admin tokens stay
  unbound and are refused: an operator makes new ones.
* Where the MAC columns had to be added, the chain heads are MACed as they stand and chains
  already cut by retention get a signed purge statement (:meth:`AuditLog.seal_upgraded`, which
  needs the master key: ``tenantkv db upgrade`` passes the cache's audit log). That trusts the
  database once, at the upgrade, and not at all on a node that has anchored heads before: there
  the columns were dropped to have the heads re-sealed over a change, so nothing is sealed and
  every check reports the heads (docs/audit.md).

Columns and tables are added only where missing (an index opened by a tenantkv between
milestone 1 and migrations may have some already).
"""

from __future__ import annotations

from alembic import context, op
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    LargeBinary,
    MetaData,
    String,
    Table,
    inspect,
    text,
)
from sqlalchemy.orm import Session

from tenantkv.audit import AuditLog

revision: str = "identity_audit_macs"
down_revision: str | None = "fleet_tables"
branch_labels: str | None = None
depends_on: str | None = None

#: The key of ``Config.attributes`` under which the runner passes the cache's audit log.
AUDIT_LOG = "tenantkv.audit_log"

_TOKEN_COLUMNS = (("tenant_id", LargeBinary(16)), ("minted_by", String(32)))
_MAC_COLUMNS = (
    ("tkv_audit_records", "mac", String(64)),
    ("tkv_audit_heads", "mac", String(64)),
    ("tkv_audit_heads", "mac_from_seq", BigInteger),
)


def _columns(connection: Connection, table: str) -> set[str]:
    return {c["name"] for c in inspect(connection).get_columns(table)}


def _indexes(connection: Connection, table: str) -> set[str]:
    return {str(i["name"]) for i in inspect(connection).get_indexes(table)}


def _upgrade_tokens(connection: Connection) -> None:
    present = _columns(connection, "tkv_api_tokens")
    missing = [(name, kind) for name, kind in _TOKEN_COLUMNS if name not in present]
    if missing:
        with op.batch_alter_table("tkv_api_tokens") as batch:
            for name, kind in missing:
                batch.add_column(Column(name, kind, nullable=True))
    indexes = _indexes(connection, "tkv_api_tokens")
    for column in ("tenant_id", "minted_by"):
        name = f"ix_tkv_api_tokens_{column}"
        if name not in indexes:
            op.create_index(name, "tkv_api_tokens", [column])
    added = {name for name, _ in missing}
    if "minted_by" in added:
        op.execute(
            text(
                "UPDATE tkv_api_tokens SET minted_by = substr(created_by, 7) "
                "WHERE created_by LIKE 'token:%'"
            )
        )
    if "tenant_id" in added:
        op.execute(
            text(
                "UPDATE tkv_api_tokens SET tenant_id = (SELECT t.id FROM tkv_tenants t "
                "WHERE t.name = tkv_api_tokens.tenant "
                "AND t.created_at <= tkv_api_tokens.created_at) "
                "WHERE role = 'tenant-admin'"
            )
        )


def _upgrade_audit(connection: Connection) -> None:
    added = False
    for table in ("tkv_audit_records", "tkv_audit_heads"):
        present = _columns(connection, table)
        missing = [(c, kind) for t, c, kind in _MAC_COLUMNS if t == table and c not in present]
        if missing:
            added = True
            with op.batch_alter_table(table) as batch:
                for name, kind in missing:
                    batch.add_column(Column(name, kind, nullable=True))
    purges = MetaData()
    Table(
        "tkv_audit_purges",
        purges,
        Column("chain", String(160), primary_key=True),
        Column("first_seq", BigInteger, nullable=False),
        Column("prev_hash", String(64), nullable=False),
        Column("time_us", BigInteger, nullable=False),
        Column("key_id", String(64), nullable=False),
        Column("signature", LargeBinary(64), nullable=False),
    )
    purges.create_all(connection, checkfirst=True)
    if added:
        audit = context.config.attributes.get(AUDIT_LOG)
        if not isinstance(audit, AuditLog):
            raise RuntimeError(
                "sealing the audit heads of an index from before MACs needs the master key: "
                "run `tenantkv db upgrade`, which passes the cache's audit log"
            )
        with Session(bind=connection) as session:
            audit.seal_upgraded(session)
            session.flush()


def upgrade() -> None:
    connection = op.get_bind()
    _upgrade_tokens(connection)
    _upgrade_audit(connection)


def downgrade() -> None:
    raise NotImplementedError("tenantkv does not downgrade an index")
