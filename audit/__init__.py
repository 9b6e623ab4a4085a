"""Tamper-evident audit log: per-tenant hash chains, signed checkpoints, exports, verification.

::

    AuditBase.metadata.create_all(engine)            # next to the cache's own tables
    log = AuditLog(master_key_wrapper)
    with db.write() as session:                      # the admin action's own transaction
        ...                                          # the action itself
        log.append(session, AuditEvent(actor="alice", role="operator", tenant="acme",
                                       action=TENANT_CREATE, target="acme"))
    with db.read() as session:
        lines = list(log.export(session, tenant="acme"))
    report = verify_export(lines, public_key_pem)    # offline: the file and the key suffice

See ``docs/audit.md`` for the formats byte by byte. This package imports ``tenantkv.crypto`` and
third-party libraries only, never the cache (``tenantkv``) itself.
"""

from .canonical import GENESIS_HASH, canonical_json
from .errors import (
    AuditChainError,
    AuditError,
    AuditRequestError,
    AuditSigningKeyError,
    AuditVerificationError,
)
from .events import (
    ACCESS_REFUSED,
    ACTIONS,
    AUDIT_EXPORT,
    AUDIT_PURGE,
    DENIED,
    FAILURE,
    KEYS_RETIRE,
    KEYS_ROTATE,
    OUTCOMES,
    QUOTA_REFUSED,
    ROLE_AUDITOR,
    ROLE_OPERATOR,
    ROLE_SYSTEM,
    ROLE_TENANT_ADMIN,
    SEGMENT_OPEN_FAILED,
    SUCCESS,
    SYSTEM_CHAIN,
    TENANT_CHAIN_PREFIX,
    TENANT_CREATE,
    TENANT_DELETE,
    TENANT_UPDATE,
    USAGE_SUMMARY,
    Attribution,
    AuditEvent,
    Outcome,
    chain_for,
    is_chain_of,
)
from .export import EXPORT_FORMATS, ExportFormat, SessionSource
from .log import DEFAULT_RETENTION_SECONDS, AuditLog
from .models import (
    AuditBase,
    AuditChainHead,
    AuditCheckpointRow,
    AuditRecordRow,
    AuditSigningKey,
)
from .records import AuditRecord, Checkpoint
from .signing import SIGNING_KEY_CONTEXT
from .verify import ChainSummary, VerifyReport, verify_export

__all__ = [
    "ACCESS_REFUSED",
    "ACTIONS",
    "AUDIT_EXPORT",
    "AUDIT_PURGE",
    "DEFAULT_RETENTION_SECONDS",
    "DENIED",
    "EXPORT_FORMATS",
    "FAILURE",
    "GENESIS_HASH",
    "KEYS_RETIRE",
    "KEYS_ROTATE",
    "OUTCOMES",
    "QUOTA_REFUSED",
    "ROLE_AUDITOR",
    "ROLE_OPERATOR",
    "ROLE_SYSTEM",
    "ROLE_TENANT_ADMIN",
    "SEGMENT_OPEN_FAILED",
    "SIGNING_KEY_CONTEXT",
    "SUCCESS",
    "SYSTEM_CHAIN",
    "TENANT_CHAIN_PREFIX",
    "TENANT_CREATE",
    "TENANT_DELETE",
    "TENANT_UPDATE",
    "USAGE_SUMMARY",
    "Attribution",
    "AuditBase",
    "AuditChainError",
    "AuditChainHead",
    "AuditCheckpointRow",
    "AuditError",
    "AuditEvent",
    "AuditLog",
    "AuditRecord",
    "AuditRecordRow",
    "AuditRequestError",
    "AuditSigningKey",
    "AuditSigningKeyError",
    "AuditVerificationError",
    "ChainSummary",
    "Checkpoint",
    "ExportFormat",
    "Outcome",
    "SessionSource",
    "VerifyReport",
    "canonical_json",
    "chain_for",
    "is_chain_of",
    "verify_export",
]
