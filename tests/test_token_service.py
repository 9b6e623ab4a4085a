"""The token service (``kv.tokens``) through its public API, on a real cache: who a token
authenticates, what a tenant-admin's token reaches, revocation and its cascade, and that every
change commits with its audit record or not at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tenantkv
from tenantkv import TenantKV
from tenantkv.audit import Attribution
from tenantkv.errors import InvalidRequestError, TenantNotFoundError
from tenantkv.services.tokens import BOOTSTRAP_TTL_SECONDS, AuthError, Principal, token_id_of
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


def test_the_owner_token_authenticates_as_what_it_was_made(kv: TenantKV) -> None:
    operator = kv.tokens.create("operator")
    acme = kv.tokens.create("tenant-admin", "acme")
    assert kv.tokens.authenticate(operator) == Principal(token_id_of(operator), "operator", None)
    principal = kv.tokens.authenticate(acme)
    assert (principal.token_id, principal.role, principal.tenant) == (
        token_id_of(acme),
        "tenant-admin",
        "acme",
    )
    assert principal.tenant_id is not None


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (None, "missing"),
        ("", "missing"),
        ("tkv_short", "malformed"),
        ("tkv_" + "A" * 43, "unknown"),
    ],
)
def test_tokens_that_authenticate_nobody(kv: TenantKV, token: str | None, reason: str) -> None:
    kv.tokens.create("operator")  # a table with a row: "unknown" is not an empty table's answer
    with pytest.raises(AuthError) as refused:
        kv.tokens.authenticate(token)
    assert refused.value.reason == reason


def test_a_tenant_admin_listing_holds_only_its_tenant(kv: TenantKV) -> None:
    operator = token_id_of(kv.tokens.create("operator"))
    acme = token_id_of(kv.tokens.create("tenant-admin", "acme"))
    globex = token_id_of(kv.tokens.create("tenant-admin", "globex"))
    assert {t.id for t in kv.tokens.listing()} == {operator, acme, globex}  # positive control
    assert [t.id for t in kv.tokens.listing("acme")] == [acme]
    assert [t.tenant for t in kv.tokens.listing("globex")] == ["globex"]
    assert kv.tokens.listing("initech") == []


def test_a_tenant_admin_mints_for_its_own_tenant_only(kv: TenantKV) -> None:
    minter = kv.tokens.authenticate(kv.tokens.create("tenant-admin", "acme"))
    own = kv.tokens.issue("tenant-admin", "acme", by=CALLER, minter=minter)  # positive control
    assert kv.tokens.authenticate(own.token).tenant == "acme"
    assert own.info.minted_by == minter.token_id
    with pytest.raises(TenantNotFoundError):
        kv.tokens.issue("tenant-admin", "globex", by=CALLER, minter=minter)
    assert kv.tokens.listing("globex") == []


def test_a_revoked_token_is_refused_and_what_it_minted_lapses(kv: TenantKV) -> None:
    parent = kv.tokens.create("tenant-admin", "acme")
    child = kv.tokens.issue(
        "tenant-admin", "acme", by=CALLER, minter=kv.tokens.authenticate(parent)
    ).token
    sibling = kv.tokens.create("tenant-admin", "acme")
    assert kv.tokens.authenticate(child).tenant == "acme"  # positive control
    assert kv.tokens.revoke(token_id_of(parent), by=CALLER)
    for token in (parent, child):
        with pytest.raises(AuthError, match="revoked"):
            kv.tokens.authenticate(token)
    assert kv.tokens.authenticate(sibling).tenant == "acme"  # not minted by it: unaffected
    (record,) = records(kv, "token.revoke")
    assert (record["actor"], record["request_id"], record["target"]) == (
        "token:caller",
        "req-1",
        token_id_of(parent),
    )


def test_a_revoked_minter_cannot_mint(kv: TenantKV) -> None:
    minter = kv.tokens.authenticate(kv.tokens.create("operator"))
    kv.tokens.issue("auditor", by=CALLER, minter=minter)  # positive control
    kv.tokens.revoke(minter.token_id)
    with pytest.raises(AuthError, match="revoked"):
        kv.tokens.issue("auditor", by=CALLER, minter=minter)  # the principal it held before


def test_revoking_through_a_tenant_reaches_only_that_tenants_tokens(kv: TenantKV) -> None:
    globex = kv.tokens.create("tenant-admin", "globex")
    acme = kv.tokens.create("tenant-admin", "acme")
    assert kv.tokens.revoke(token_id_of(globex), tenant="acme") is False
    assert kv.tokens.authenticate(globex).tenant == "globex"
    assert kv.tokens.revoke(token_id_of(acme), tenant="acme") is True  # positive control
    assert kv.tokens.revoke("0123456789abcdef") is False
    with pytest.raises(InvalidRequestError):
        kv.tokens.revoke("not-an-id")


def test_deleting_the_tenant_disables_its_tokens(kv: TenantKV) -> None:
    acme = kv.tokens.create("tenant-admin", "acme")
    kv.delete_tenant("acme")
    kv.create_tenant("acme")  # another tenant of the same name: not controlled by the old admin
    with pytest.raises(AuthError):
        kv.tokens.authenticate(acme)


def test_expiry_and_a_tenant_admins_bounded_lifetime(kv: TenantKV, clock: ManualClock) -> None:
    token = kv.tokens.create("tenant-admin", "acme", ttl_seconds=60)
    principal = kv.tokens.authenticate(token)
    assert principal.expires_at == clock.now + 60
    clock.advance(20)
    assert kv.tokens.bounded_ttl(principal, None, 3600) == 40
    assert kv.tokens.bounded_ttl(principal, 10, 3600) == 10
    unlimited = kv.tokens.authenticate(kv.tokens.create("tenant-admin", "acme"))
    assert kv.tokens.bounded_ttl(unlimited, None, 3600) == 3600
    operator = kv.tokens.authenticate(kv.tokens.create("operator"))
    assert kv.tokens.bounded_ttl(operator, None, 3600) is None
    clock.advance(41)
    with pytest.raises(AuthError, match="expired"):
        kv.tokens.authenticate(token)


def test_the_first_operator_token_is_made_once_per_index_and_expires(
    kv: TenantKV, clock: ManualClock
) -> None:
    first = kv.tokens.ensure_first_operator()
    assert first is not None and kv.tokens.authenticate(first).role == "operator"
    assert kv.tokens.authenticate(first).expires_at == clock.now + BOOTSTRAP_TTL_SECONDS
    assert kv.tokens.ensure_first_operator() is None
    kv.tokens.revoke(token_id_of(first))
    assert kv.tokens.ensure_first_operator() is None  # revoked: recovered on the host, not here
    clock.advance(BOOTSTRAP_TTL_SECONDS + 1)
    assert kv.tokens.ensure_first_operator() is None  # expired: the same
    (record,) = [r for r in records(kv, "token.create") if r["target"] == token_id_of(first)]
    assert record["details"]["purpose"] == "bootstrap"


def test_a_bootstrap_token_must_expire(kv: TenantKV) -> None:
    with pytest.raises(InvalidRequestError, match="expiry"):
        kv.tokens.ensure_first_operator(None)  # type: ignore[arg-type]
    assert kv.tokens.ensure_first_operator(3600) is not None  # positive control


def test_a_mint_commits_with_its_audit_record_or_not_at_all(
    kv: TenantKV, monkeypatch: pytest.MonkeyPatch
) -> None:
    issued = kv.tokens.issue("tenant-admin", "acme", 120, by=CALLER)
    (record,) = [r for r in records(kv, "token.create") if r["target"] == issued.info.id]
    assert (record["actor"], record["request_id"], record["tenant"]) == (
        "token:caller",
        "req-1",
        "acme",
    )
    assert [t.id for t in kv.tokens.listing("acme")] == [issued.info.id]

    def fail(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the audit log is down")

    monkeypatch.setattr(kv.context.audit, "append", fail)
    with pytest.raises(RuntimeError):
        kv.tokens.issue("tenant-admin", "acme", by=CALLER)
    with pytest.raises(RuntimeError):
        kv.tokens.revoke(issued.info.id, by=CALLER)
    monkeypatch.undo()
    assert [t.id for t in kv.tokens.listing("acme")] == [issued.info.id]  # no unaudited token
    assert kv.tokens.authenticate(issued.token).tenant == "acme"  # and no unaudited revocation
