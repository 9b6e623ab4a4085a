"""Alembic's environment: run the revisions on the connection :mod:`tenantkv.index.migrate`
hands over, inside the transaction it already opened (and the locks it holds there).

Nothing here reads a URL or a file: the caller owns the connection, so a PostgreSQL index's
``search_path`` (its schema) and SQLite's write lock are the caller's, and both dialects run the
whole upgrade as one transaction (PostgreSQL and SQLite both have transactional DDL).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection


def _run() -> None:
    connection = context.config.attributes.get("connection")
    if not isinstance(connection, Connection):
        raise RuntimeError(
            "tenantkv migrations run through tenantkv.index.migrate (tenantkv db upgrade), "
            "which passes its connection; they cannot run offline or from alembic.ini"
        )
    context.configure(
        connection=connection,
        # SQLite cannot ALTER most things; batch_alter_table copies the table where needed.
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()


# Alembic runs this file with its context set up; a module scan (the package check) only imports it.
if hasattr(context, "config"):
    _run()
