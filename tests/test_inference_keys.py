"""Inference keys (``kv.inference_keys``) through the service, the admin API and the CLI, on
both index backends: mint, list, revoke, expiry; only hashes at rest; a tenant-admin confined to
its own tenant; a key bound to its tenant's incarnation; use counted per key without an index
write per request; admin tokens and inference keys never standing in for each other; an index
from the previous revision upgraded to hold the table."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select, text, update

import tenantkv
from tenantkv import SchemaVersionError, TenantKV
from tenantkv.audit import Attribution
from tenantkv.cli import main
from tenantkv.config import config_for_root
from tenantkv.crypto import KeyEncryptionKey, KeyFileProvider
from tenantkv.errors import InvalidRequestError, TenantNotFoundError
from tenantkv.index.inference_keys import InferenceKey
from tenantkv.index.migrate import head_revision
from tenantkv.services.inference_keys import InferenceIdentity, InferenceKeyService, key_id_of
from tenantkv.services.schema_upgrade import upgrade_index
from tenantkv.services.tokens import AuthError
from tests.helpers import ManualClock
from tests.indexes import Index

CALLER = Attribution("token:caller", "operator", "req-1")


@pytest.fixture(name="clock")
def clock_fixture() -> ManualClock:
    return ManualClock(1_700_000_000.0)


@pytest.fixture(name="kv")
def kv_fixture(tmp_path: Path, index: Index, clock: ManualClock) -> Iterator[TenantKV]:
    with tenantkv.open(tmp_path / "cache", durable=False, clock=clock) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        yield kv


def records(kv: TenantKV, action: str) -> list[dict[str, Any]]:
    lines = map(json.loads, kv.audit.export(tenant=None))
    return [r for r in lines if r.get("type") == "record" and r.get("action") == action]


def all_records(kv: TenantKV) -> int:
    return sum(1 for line in kv.audit.export(tenant=None) if '"type": "record"' in line)


def key_rows(kv: TenantKV) -> list[InferenceKey]:
    with kv.context.index.read() as session:
        return list(session.scalars(select(InferenceKey)).all())


# ---- mint, list, revoke, expiry ------------------------------------------------------------------


def test_a_minted_key_authenticates_as_its_tenant_scope_and_incarnation(kv: TenantKV) -> None:
    info, secret = kv.inference_keys.create("acme", "chat-app", scope="team-a", expires_in=3600)
    assert secret.startswith("tkvi_") and len(secret) == 48
    assert info.id == key_id_of(secret)
    assert (info.name, info.tenant, info.scope) == ("chat-app", "acme", "team-a")
    assert info.expires_at == kv.now() + 3600
    incarnation = kv.tenant_incarnation("acme")
    assert incarnation is not None
    assert kv.inference_keys.authenticate(secret) == InferenceIdentity(
        key_id=info.id, tenant="acme", scope="team-a", incarnation=incarnation.incarnation
    )
    _, unscoped = kv.inference_keys.create("acme", "batch")
    identity = kv.inference_keys.authenticate(unscoped)
    assert identity is not None and identity.scope is None
    # a key of another tenant is that tenant's
    _, other = kv.inference_keys.create("globex", "chat-app", scope="team-a")
    identity = kv.inference_keys.authenticate(other)
    assert identity is not None and identity.tenant == "globex"


def test_listing_shows_a_tenants_keys_without_secrets(kv: TenantKV) -> None:
    first, secret = kv.inference_keys.create("acme", "one", scope="s")
    second, _ = kv.inference_keys.create("acme", "two")
    kv.inference_keys.create("globex", "theirs")
    listed = kv.inference_keys.list("acme")
    assert {info.id for info in listed} == {first.id, second.id}
    assert secret not in repr(listed)
    assert hashlib.sha256(secret.encode()).hexdigest() not in repr(listed)
    with pytest.raises(TenantNotFoundError):
        kv.inference_keys.list("no-such-tenant")


def test_revoked_and_expired_keys_authenticate_nothing(kv: TenantKV, clock: ManualClock) -> None:
    kept, kept_secret = kv.inference_keys.create("acme", "kept")
    doomed, doomed_secret = kv.inference_keys.create("acme", "doomed")
    _, short_secret = kv.inference_keys.create("acme", "short", expires_in=60)
    assert kv.inference_keys.authenticate(doomed_secret) is not None  # control
    assert kv.inference_keys.revoke("acme", doomed.id, actor=CALLER) is True
    assert kv.inference_keys.authenticate(doomed_secret) is None
    assert kv.inference_keys.authenticate(kept_secret) is not None  # only that one
    revoked = {info.id: info for info in kv.inference_keys.list("acme")}[doomed.id]
    assert revoked.revoked_at == kv.now()

    clock.advance(59)
    assert kv.inference_keys.authenticate(short_secret) is not None  # control: not yet
    clock.advance(1)
    assert kv.inference_keys.authenticate(short_secret) is None
    assert kv.inference_keys.authenticate(kept_secret) is not None

    assert kv.inference_keys.revoke("acme", "0123456789abcdef") is False
    with pytest.raises(InvalidRequestError):
        kv.inference_keys.revoke("acme", "not-a-key-id")
    with pytest.raises(TenantNotFoundError):
        kv.inference_keys.revoke("no-such-tenant", kept.id)


@pytest.mark.parametrize(
    "secret",
    ["", "tkvi_", "tkvi_" + "A" * 42, "tkvi_" + "A" * 44, "tkvi_" + "!" * 43, "TKVI_" + "A" * 43],
)
def test_malformed_and_unknown_keys_authenticate_nothing(kv: TenantKV, secret: str) -> None:
    kv.inference_keys.create("acme", "app")
    assert kv.inference_keys.authenticate(secret) is None
    assert kv.inference_keys.authenticate("tkvi_" + "A" * 43) is None  # well formed, unknown


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "key name"),
        ({"name": "a b"}, "key name"),
        ({"scope": ""}, "scope"),
        ({"scope": "x" * 257}, "scope"),
        ({"scope": "a\nb"}, "scope"),
        ({"expires_in": 0}, "expires_in"),
        ({"expires_in": -1}, "expires_in"),
        ({"expires_in": float("nan")}, "expires_in"),
        ({"expires_in": float("inf")}, "expires_in"),
        ({"expires_in": 367 * 86400}, "expires_in"),
        ({"expires_in": True}, "expires_in"),
    ],
)
def test_bad_mint_arguments_are_refused_and_mint_nothing(
    kv: TenantKV, kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {"name": "app", **kwargs}
    name = args.pop("name")
    with pytest.raises(InvalidRequestError, match=match):
        kv.inference_keys.create("acme", name, **args)
    assert key_rows(kv) == []
    with pytest.raises(TenantNotFoundError):
        kv.inference_keys.create("no-such-tenant", "app")


def test_mint_and_revoke_are_audited_and_authentication_is_not(kv: TenantKV) -> None:
    info, secret = kv.inference_keys.create("acme", "app", scope="s", actor=CALLER)
    (minted,) = records(kv, "inference_key.create")
    assert minted["actor"] == "token:caller" and minted["tenant"] == "acme"
    assert minted["details"]["key_id"] == info.id and minted["details"]["scope"] == "s"
    assert secret not in json.dumps(minted)
    before = all_records(kv)
    for _ in range(20):
        assert kv.inference_keys.authenticate(secret) is not None
    kv.inference_keys.flush_uses()
    assert all_records(kv) == before  # use is counted, not audited
    kv.inference_keys.revoke("acme", info.id, actor=CALLER)
    (revoked,) = records(kv, "inference_key.revoke")
    assert revoked["details"]["key_id"] == info.id and revoked["actor"] == "token:caller"


# ---- at rest ---------------------------------------------------------------------------------


def test_only_the_hash_of_a_key_is_stored(kv: TenantKV) -> None:
    info, secret = kv.inference_keys.create("acme", "app", scope="s")
    with kv.context.index.read() as session:
        rows = session.execute(text("SELECT * FROM tkv_inference_keys")).all()
    assert len(rows) == 1
    stored = [str(value) for value in rows[0]]
    assert hashlib.sha256(secret.encode()).hexdigest() in stored  # positive control
    assert info.id in stored
    assert not any(secret in value or secret[5:] in value for value in stored)


# ---- incarnation ---------------------------------------------------------------------------------


def test_a_key_of_a_deleted_tenant_opens_nothing_of_the_next_tenant_of_its_name(
    kv: TenantKV,
) -> None:
    old, old_secret = kv.inference_keys.create("acme", "app", scope="s")
    first = kv.inference_keys.authenticate(old_secret)
    assert first is not None  # control
    kv.delete_tenant("acme")
    assert kv.inference_keys.authenticate(old_secret) is None
    (revoked,) = [row for row in key_rows(kv) if row.id == old.id]
    assert revoked.revoked_at is not None  # the deletion revoked it
    kv.create_tenant("acme")
    assert kv.inference_keys.authenticate(old_secret) is None
    # even a row the deletion missed (revocation undone behind the service's back) stays
    # bound to the incarnation it was minted for
    with kv.context.index.write() as session:
        session.execute(update(InferenceKey).values(revoked_at=None))
    assert kv.inference_keys.authenticate(old_secret) is None
    assert kv.inference_keys.list("acme") == []  # the new tenant has no keys
    _, new_secret = kv.inference_keys.create("acme", "app", scope="s")
    fresh = kv.inference_keys.authenticate(new_secret)
    current = kv.tenant_incarnation("acme")
    assert fresh is not None and current is not None
    assert fresh.incarnation == current.incarnation != first.incarnation


def test_deleting_a_tenant_leaves_other_tenants_keys_working(kv: TenantKV) -> None:
    _, acme = kv.inference_keys.create("acme", "app")
    _, globex = kv.inference_keys.create("globex", "app")
    kv.delete_tenant("acme")
    assert kv.inference_keys.authenticate(acme) is None
    assert kv.inference_keys.authenticate(globex) is not None


# ---- admin tokens and inference keys -----------------------------------------------------------


def test_an_admin_token_is_no_inference_key_and_an_inference_key_no_admin_token(
    kv: TenantKV,
) -> None:
    operator = kv.tokens.create("operator")
    admin = kv.tokens.create("tenant-admin", "acme")
    _, secret = kv.inference_keys.create("acme", "app")
    # positive controls: each authenticates with its own service
    assert kv.tokens.authenticate(operator).role == "operator"
    assert kv.tokens.authenticate(admin).tenant == "acme"
    assert kv.inference_keys.authenticate(secret) is not None
    for token in (operator, admin):
        assert kv.inference_keys.authenticate(token) is None
        # nor with the inference prefix put on an admin token's body
        assert kv.inference_keys.authenticate("tkvi_" + token.removeprefix("tkv_")) is None
    with pytest.raises(AuthError, match="malformed"):
        kv.tokens.authenticate(secret)
    with pytest.raises(AuthError, match="unknown"):  # its body under the admin prefix
        kv.tokens.authenticate("tkv_" + secret.removeprefix("tkvi_"))


# ---- counting --------------------------------------------------------------------------------


class Statements:
    """Every statement any engine sends while it listens (SQLAlchemy's cursor events)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        self.seen.append(" ".join(statement.split()).upper())

    def __enter__(self) -> Statements:
        event.listen(Engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self)

    def writes(self) -> list[str]:
        return [s for s in self.seen if s.startswith(("INSERT", "UPDATE", "DELETE"))]

    def reads_of(self, table: str) -> list[str]:
        return [s for s in self.seen if s.startswith("SELECT") and table.upper() in s]


def test_use_is_counted_per_key_without_an_index_write_per_request(kv: TenantKV) -> None:
    keys = InferenceKeyService(kv.context, flush_interval=3600.0)  # only explicit flushes
    busy, busy_secret = keys.create("acme", "busy")
    quiet, quiet_secret = keys.create("acme", "quiet")
    idle, _ = keys.create("globex", "idle")
    with Statements() as statements:
        for _ in range(50):
            assert keys.authenticate(busy_secret) is not None
        for _ in range(3):
            assert keys.authenticate(quiet_secret) is not None
    assert statements.writes() == []
    assert len(statements.reads_of("tkv_inference_keys")) == 53  # one lookup per request
    with Statements() as statements:
        keys.flush_uses()
    assert len(statements.writes()) == 2  # one batch: an update per key used
    used = {info.id: info for info in keys.list("acme") + keys.list("globex")}
    assert (used[busy.id].uses, used[quiet.id].uses, used[idle.id].uses) == (50, 3, 0)
    assert used[busy.id].last_used_at == kv.now() and used[idle.id].last_used_at is None
    for _ in range(2):
        keys.authenticate(quiet_secret)
    keys.close()
    assert {info.id: info.uses for info in keys.list("acme")}[quiet.id] == 5  # added to


def test_counts_reach_the_index_within_the_flush_interval_and_at_close(
    tmp_path: Path, index: Index
) -> None:
    with tenantkv.open(tmp_path / "c", durable=False) as kv:
        kv.create_tenant("acme")
        keys = InferenceKeyService(kv.context, flush_interval=0.2)
        info, secret = keys.create("acme", "app")
        for _ in range(7):
            keys.authenticate(secret)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if {row.id: row.uses for row in key_rows(kv)}[info.id] == 7:
                break
            time.sleep(0.05)
        assert {row.id: row.uses for row in key_rows(kv)}[info.id] == 7
        # the facade's service writes its pending counts when the cache closes
        for _ in range(4):
            kv.inference_keys.authenticate(secret)
    with tenantkv.open(tmp_path / "c", durable=False, create=False) as kv:
        assert {row.id: row.uses for row in key_rows(kv)}[info.id] == 11


# ---- the previous revision upgraded --------------------------------------------------------------


def test_an_index_of_the_previous_revision_upgrades_to_hold_inference_keys(
    tmp_path: Path, index: Index
) -> None:
    root = tmp_path / "old"
    with tenantkv.open(root) as kv:
        kv.create_tenant("acme")
    engine = create_engine(index.url(root))
    try:
        with engine.begin() as connection:
            connection.execute(text("DROP TABLE tkv_inference_keys"))
            connection.execute(
                text("UPDATE alembic_version SET version_num = 'blocks_by_extent_slot'")
            )
    finally:
        engine.dispose()
    with pytest.raises(SchemaVersionError, match="blocks_by_extent_slot"):
        tenantkv.open(root)
    key = KeyEncryptionKey(KeyFileProvider(root / "master.key", create=False).load())
    done = upgrade_index(config_for_root(root), key)
    assert (done.before, done.after) == ("blocks_by_extent_slot", head_revision())
    with tenantkv.open(root) as kv:
        _, secret = kv.inference_keys.create("acme", "app")
        assert kv.inference_keys.authenticate(secret) is not None


# ---- the CLI ---------------------------------------------------------------------------------


def test_the_cli_creates_lists_and_revokes_keys(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cli"
    with tenantkv.open(root) as kv:
        kv.create_tenant("acme")
    assert (
        main(["key", "create", str(root), "--tenant", "acme", "--name", "app", "--scope", "s"]) == 0
    )
    out = capsys.readouterr()
    secret = out.out.strip()
    assert secret.startswith("tkvi_") and key_id_of(secret) in out.err
    assert main(["key", "list", str(root), "--tenant", "acme"]) == 0
    listed = capsys.readouterr().out
    assert key_id_of(secret) in listed and "active" in listed and secret not in listed
    with tenantkv.open(root, create=False) as kv:
        assert kv.inference_keys.authenticate(secret) is not None
        (minted,) = records(kv, "inference_key.create")
        assert minted["actor"].startswith("cli:")
    assert main(["key", "revoke", key_id_of(secret), str(root), "--tenant", "acme"]) == 0
    assert main(["key", "revoke", key_id_of(secret), str(root), "--tenant", "nobody"]) == 2
    assert main(["key", "revoke", "0123456789abcdef", str(root), "--tenant", "acme"]) == 1
    assert main(["key", "list", str(root), "--tenant", "acme"]) == 0
    assert "revoked" in capsys.readouterr().out
    with tenantkv.open(root, create=False) as kv:
        assert kv.inference_keys.authenticate(secret) is None
    # an existing cache only: a mistyped root is refused, not created
    assert main(["key", "list", str(tmp_path / "typo"), "--tenant", "acme"]) == 2
    assert not (tmp_path / "typo").exists()
