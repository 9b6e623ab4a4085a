"""Schema migrations (Alembic): an index written by milestone 1, with data in it, upgraded by
``tenantkv db upgrade`` and then used; opening an old index refuses and changes nothing; a fresh
index is stamped at the head; the migrated schema is the one the models create.

The milestone-1 index is rebuilt on either backend from a frozen copy of its tables
(``tests/milestone1_schema.py``) and the rows a milestone-1 cache wrote
(``tests/data/milestone1``, made by ``generate_milestone1.py`` there), next to that cache's key
file and extent files.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, insert, inspect, text

import tenantkv
from tenantkv import KVLayout, SchemaVersionError
from tenantkv.audit import AuditLog, verify_export
from tenantkv.cli import main
from tenantkv.config import config_for_root
from tenantkv.crypto import KeyEncryptionKey, KeyFileProvider, new_key
from tenantkv.index import migrate
from tenantkv.index.database import Database
from tenantkv.index.migrations.versions.identity_audit_macs import AUDIT_LOG
from tenantkv.services.schema_upgrade import upgrade_index
from tests import milestone1_schema
from tests.indexes import Index

DATA = Path(__file__).parent / "data" / "milestone1"
MIGRATIONS = Path(migrate.__file__).with_name("migrations")
LAYERS, TOKENS = 2, 128  # as generate_milestone1.py stored them
LAYOUT = KVLayout.mla(LAYERS, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(1000, 1000 + TOKENS))
MILESTONE1_TIME = 1_780_000_000.0  # the clock generate_milestone1.py gave the cache


def stored_layer(index: int) -> torch.Tensor:
    values = torch.arange(TOKENS * 576, dtype=torch.float32).reshape(TOKENS, 576)
    return (values % 251 - 125 + index).to(torch.bfloat16)


def then() -> float:
    """A time just after milestone 1 wrote the cache (its clock), before its extents expire."""
    return MILESTONE1_TIME + 100.0


def master_key(root: Path) -> KeyEncryptionKey:
    return KeyEncryptionKey(KeyFileProvider(root / "master.key", create=False).load())


def _decoded(value: Any) -> Any:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value


def milestone1_cache(tmp_path: Path, index: Index) -> tuple[Path, dict[str, str]]:
    """A cache root as milestone 1 left it (index on ``index``'s backend); its tokens."""
    root = tmp_path / "m1"
    shutil.copytree(DATA / "root", root)
    for path in [root, *root.rglob("*")]:  # git keeps no modes: a readable key file is refused
        path.chmod(0o700 if path.is_dir() else 0o600)
    dump = json.loads((DATA / "rows.json").read_text())
    engine = create_engine(index.url(root))
    try:
        with engine.begin() as connection:
            for metadata in milestone1_schema.METADATA:
                metadata.create_all(connection)
                for table in metadata.sorted_tables:
                    rows = dump["tables"].get(table.name, [])
                    values = [{k: _decoded(v) for k, v in row.items()} for row in rows]
                    if values:
                        connection.execute(insert(table), values)
    finally:
        engine.dispose()
    if index.is_sqlite:
        (root / "index.db").chmod(0o600)
    return root, dump["tokens"]


def rows_of(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table at ``url`` (sorted), to show that nothing changed."""
    engine = create_engine(url)
    rows: dict[str, list[tuple[Any, ...]]] = {}
    try:
        with engine.connect() as connection:
            for name in sorted(inspect(connection).get_table_names()):
                found = connection.execute(text(f'SELECT * FROM "{name}"'))
                rows[name] = sorted((tuple(row) for row in found), key=repr)
    finally:
        engine.dispose()
    return rows


def revision_at(url: str) -> migrate.SchemaState:
    database = Database(url)
    try:
        return migrate.current_revision(database)
    finally:
        database.close()


def schema_differences(url: str) -> list[Any]:
    """What Alembic's autogenerate finds between the database at ``url`` and today's models."""
    merged = MetaData()
    for metadata in migrate.all_metadata():
        for table in metadata.tables.values():
            table.to_metadata(merged)
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return list(compare_metadata(MigrationContext.configure(connection), merged))
    finally:
        engine.dispose()


def test_an_upgraded_milestone1_cache_serves_its_old_data(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root, tokens = milestone1_cache(tmp_path, index)
    assert main(["db", "upgrade", str(root)]) == 0
    assert "upgraded from before migrations to" in capsys.readouterr().out
    assert revision_at(index.url(root)).revision == migrate.head_revision()
    with tenantkv.open(root, clock=then) as kv:
        acme = kv.namespace("acme", model="tiny-m1", layout=LAYOUT)
        assert acme.lookup(PROMPT) == TOKENS
        with acme.load(PROMPT) as stream:
            loaded = dict(stream)
        assert sorted(loaded) == list(range(LAYERS))
        for layer, tensor in loaded.items():
            assert torch.equal(tensor, stored_layer(layer))  # byte-exact, milestone 1's bytes
        globex = kv.namespace("globex", model="tiny-m1", layout=LAYOUT)
        assert globex.lookup(PROMPT) == 0  # isolation survives the upgrade
        assert kv.tokens.authenticate(tokens["operator"]).role == "operator"
        admin = kv.tokens.authenticate(tokens["acme_admin"])
        assert (admin.role, admin.tenant) == ("tenant-admin", "acme")  # tenant_id backfilled
        for tenant in ("acme", None):
            lines = list(kv.context.audit.export(kv.context.index.read, tenant=tenant))
            with kv.context.index.read() as session:
                pem = kv.context.audit.public_key_pem(session)
            report = verify_export(lines, pem)
            assert report.ok, report.problems
        kv.create_tenant("initech")  # and the log goes on, with MACs now
    assert main(["db", "upgrade", str(root)]) == 0  # a second upgrade is a no-op
    assert "nothing to do" in capsys.readouterr().out


def test_opening_a_milestone1_index_refuses_naming_the_command_and_changes_nothing(
    tmp_path: Path, index: Index
) -> None:
    root, _ = milestone1_cache(tmp_path, index)
    before = rows_of(index.url(root))
    with pytest.raises(SchemaVersionError, match=r"predates schema migrations") as refused:
        tenantkv.open(root, clock=then)
    assert f"tenantkv db upgrade {root}" in str(refused.value)
    with pytest.raises(SchemaVersionError, match=r"TENANTKV_DATABASE_URL=") as by_url:
        tenantkv.open(root, database_url=index.url(root))
    assert f"tenantkv db upgrade {root}" in str(by_url.value)
    assert rows_of(index.url(root)) == before
    assert revision_at(index.url(root)).revision is None
    upgrade_index(config_for_root(root), master_key(root))
    with tenantkv.open(root, clock=then) as kv:  # positive control: upgraded, it opens
        assert [t.name for t in kv.list_tenants()] == ["acme", "globex"]


def test_an_older_or_newer_revision_is_refused(tmp_path: Path, index: Index) -> None:
    root = tmp_path / "c"
    tenantkv.open(root, clock=then).close()
    url = index.url(root)
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'fleet_tables'"))
        with pytest.raises(SchemaVersionError, match=r"'fleet_tables', older.*db upgrade"):
            tenantkv.open(root, clock=then)
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = 'from_the_future'"))
        with pytest.raises(SchemaVersionError, match=r"does not know.*newer tenantkv"):
            tenantkv.open(root, clock=then)
        with pytest.raises(SchemaVersionError, match="does not downgrade"):
            upgrade_index(config_for_root(root), master_key(root))
    finally:
        engine.dispose()


def test_a_fresh_index_is_stamped_at_head(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "fresh"
    assert main(["db", "current", str(root)]) == 0
    assert "no index yet" in capsys.readouterr().out
    with tenantkv.open(root, clock=then) as kv:
        kv.create_tenant("acme")
    assert revision_at(index.url(root)).revision == migrate.head_revision()
    assert main(["db", "current", str(root)]) == 0
    assert f"{migrate.head_revision()} (up to date)" in capsys.readouterr().out
    before = rows_of(index.url(root))
    assert main(["db", "upgrade", str(root)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert rows_of(index.url(root)) == before
    assert schema_differences(index.url(root)) == []


def test_the_migrated_schema_is_the_one_the_models_create(tmp_path: Path, index: Index) -> None:
    root, _ = milestone1_cache(tmp_path, index)
    assert schema_differences(index.url(root)) != []  # positive control: milestone 1 differs
    upgrade_index(config_for_root(root), master_key(root))
    assert schema_differences(index.url(root)) == []
    scratch = index.database_url(tmp_path / "scratch.db")  # every revision, from nothing
    engine = create_engine(scratch)
    try:
        with engine.begin() as connection:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = connection
            config.attributes[AUDIT_LOG] = AuditLog(KeyEncryptionKey(new_key()))
            command.upgrade(config, "head")
    finally:
        engine.dispose()
    assert schema_differences(scratch) == []


def test_two_nodes_upgrading_at_once_take_turns(tmp_path: Path, index: Index) -> None:
    root, _ = milestone1_cache(tmp_path, index)
    key = master_key(root)
    outcomes: list[Any] = []

    def node() -> None:
        try:
            outcomes.append(upgrade_index(config_for_root(root), key))
        except Exception as err:  # reported below
            outcomes.append(err)

    threads = [threading.Thread(target=node) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    head = migrate.head_revision()
    pairs = sorted(((o.before or ""), o.after) for o in outcomes)
    assert pairs == [("", head), (head, head)], outcomes  # one upgraded, the other found it done
    with tenantkv.open(root, clock=then) as kv:
        lines = list(kv.context.audit.export(kv.context.index.read, tenant="acme"))
        with kv.context.index.read() as session:
            pem = kv.context.audit.public_key_pem(session)
        assert verify_export(lines, pem).ok  # sealed once, not twice over


def test_upgrade_refuses_a_wrong_master_key_and_changes_nothing(
    tmp_path: Path, index: Index
) -> None:
    root, _ = milestone1_cache(tmp_path, index)
    before = rows_of(index.url(root))
    with pytest.raises(tenantkv.MasterKeyError):
        upgrade_index(config_for_root(root), KeyEncryptionKey(bytes(32)))
    assert rows_of(index.url(root)) == before
    right = master_key(root)
    assert upgrade_index(config_for_root(root), right).before is None  # positive control
