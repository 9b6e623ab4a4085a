"""Record lines for SIEMs: ArcSight CEF and OCSF (API Activity, class 6003).

These formats are for ingestion and alerting, not proof: they carry the chain fields (chain, seq,
hash, prev_hash) so an analyst can tie an alert back to the verifiable JSON Lines export, but
only the JSONL export is signed and checked by ``audit verify``.

**CEF** (ArcSight Common Event Format rev. 25)::

    CEF:0|tenantkv|tenantkv|<version>|<action>|<action> <outcome>|<severity>|<extension>

Header fields escape ``\\`` and ``|``; extension values escape ``\\``, ``=``, and line breaks
(``\\n``, ``\\r``). Extension keys: ``rt`` (ms since epoch), ``act`` (action), ``suser`` (actor),
``spriv`` (role), ``outcome``, ``externalId`` (request id, when set), ``cs1`` tenant (omitted
for the system chain), ``cs2`` target, ``cs3`` chain, ``cn1`` seq, ``cs4`` hash, ``cs5`` prev
hash, ``msg`` details as canonical JSON; every ``csN``/``cnN`` has its ``csNLabel``. Severity:
3 success, 6 failure, 8 denied.

**OCSF** 1.1 API Activity (``class_uid`` 6003, ``category_uid`` 6): one JSON object per line with
``activity_id`` (1 create, 3 update, 4 delete, 2 read for exports, 99 other), ``type_uid`` =
6003 x 100 + activity_id, ``time`` (ms), ``severity_id``, ``status_id`` (1 success, 2 failure or
denied; ``status_detail`` says which), ``actor.user.name``, ``api.operation`` (the action),
``api.request.uid`` (request id), ``resources[0].name`` (target), ``src_endpoint`` (from
``details["client_ip"]`` when given), ``metadata.tenant_uid`` (the tenant; absent for system
events), ``metadata.uid`` = ``"<chain>:<seq>"``, ``metadata.sequence`` = seq,
``metadata.log_name`` = chain, and ``unmapped`` with role, chain, hash, prev_hash and details.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import metadata
from typing import Any

from .canonical import canonical_json, escape_line_breaks
from .records import AuditRecord

OCSF_SCHEMA_VERSION = "1.1.0"
API_ACTIVITY_CLASS_UID = 6003
APPLICATION_ACTIVITY_CATEGORY_UID = 6

_CEF_SEVERITY = {"success": 3, "failure": 6, "denied": 8}
_OCSF_SEVERITY = {"success": 1, "failure": 3, "denied": 4}  # informational / medium / high
_ACTIVITY_BY_VERB = {"create": 1, "update": 3, "delete": 4, "rotate": 3, "retire": 3, "export": 2}
_ACTIVITY_NAMES = {1: "Create", 2: "Read", 3: "Update", 4: "Delete", 99: "Other"}


@cache
def product_version() -> str:
    try:
        return metadata.version("tenantkv")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def _cef_header(value: str) -> str:
    return value.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _cef_value(value: str) -> str:
    return (
        value.replace("\\", "\\\\")
        .replace("=", "\\=")
        .replace("\r\n", "\\n")
        .replace("\n", "\\n")
        .replace("\r", "\\r")
    )


def cef_line(record: AuditRecord) -> str:
    """One ArcSight CEF line for ``record`` (see the module docstring for the mapping)."""
    header = [
        "CEF:0",
        "tenantkv",
        "tenantkv",
        product_version(),
        record.action,
        f"{record.action} {record.outcome}",
        str(_CEF_SEVERITY.get(record.outcome, 5)),
    ]
    fields: list[tuple[str, str]] = [
        ("rt", str(record.time_us // 1000)),
        ("act", record.action),
        ("suser", record.actor),
        ("spriv", record.role),
        ("outcome", record.outcome),
    ]
    if record.request_id is not None:
        fields.append(("externalId", record.request_id))
    if record.tenant is not None:
        fields += [("cs1Label", "tenant"), ("cs1", record.tenant)]
    fields += [
        ("cs2Label", "target"),
        ("cs2", record.target),
        ("cs3Label", "chain"),
        ("cs3", record.chain),
        ("cn1Label", "seq"),
        ("cn1", str(record.seq)),
        ("cs4Label", "hash"),
        ("cs4", record.hash),
        ("cs5Label", "prevHash"),
        ("cs5", record.prev_hash),
        ("msg", canonical_json(dict(record.details)).decode("utf-8")),
    ]
    extension = " ".join(f"{key}={_cef_value(value)}" for key, value in fields)
    return "|".join(_cef_header(part) for part in header) + "|" + extension


def _activity_id(action: str) -> int:
    verb = action.rsplit(".", 1)[-1]
    return _ACTIVITY_BY_VERB.get(verb, 99)


def ocsf_event(record: AuditRecord) -> dict[str, Any]:
    """The OCSF API Activity object for ``record``."""
    activity_id = _activity_id(record.action)
    details = dict(record.details)
    meta: dict[str, Any] = {
        "version": OCSF_SCHEMA_VERSION,
        "product": {"name": "tenantkv", "vendor_name": "tenantkv", "version": product_version()},
        "uid": f"{record.chain}:{record.seq}",
        "sequence": record.seq,
        "log_name": record.chain,
        "logged_time": record.time_us // 1000,
    }
    if record.tenant is not None:
        meta["tenant_uid"] = record.tenant
    if record.request_id is not None:
        meta["correlation_uid"] = record.request_id
    api: dict[str, Any] = {"operation": record.action, "service": {"name": "tenantkv"}}
    if record.request_id is not None:
        api["request"] = {"uid": record.request_id}
    client_ip = details.get("client_ip")
    src_endpoint = {"ip": client_ip} if isinstance(client_ip, str) else {"name": "unknown"}
    event: dict[str, Any] = {
        "activity_id": activity_id,
        "activity_name": _ACTIVITY_NAMES[activity_id],
        "category_uid": APPLICATION_ACTIVITY_CATEGORY_UID,
        "category_name": "Application Activity",
        "class_uid": API_ACTIVITY_CLASS_UID,
        "class_name": "API Activity",
        "type_uid": API_ACTIVITY_CLASS_UID * 100 + activity_id,
        "time": record.time_us // 1000,
        "severity_id": _OCSF_SEVERITY.get(record.outcome, 0),
        "status_id": 1 if record.outcome == "success" else 2,
        "status": "Success" if record.outcome == "success" else "Failure",
        "status_detail": record.outcome,
        "message": f"{record.action} {record.outcome}",
        "metadata": meta,
        "actor": {"user": {"name": record.actor}},
        "api": api,
        "src_endpoint": src_endpoint,
        "resources": [{"name": record.target}] if record.target else [],
        "unmapped": {
            "role": record.role,
            "chain": record.chain,
            "hash": record.hash,
            "prev_hash": record.prev_hash,
            "details": details,
        },
    }
    return event


def ocsf_line(record: AuditRecord) -> str:
    """One OCSF event as compact JSON, on one line however it is split (U+2028 etc. escaped)."""
    return escape_line_breaks(
        json.dumps(ocsf_event(record), separators=(",", ":"), ensure_ascii=False)
    )
