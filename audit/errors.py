"""Error types of the audit log, one per failure family.

* :class:`AuditRequestError` -- the caller asked for something malformed (an event with a bad
  field, an export with an unknown format or an inverted time range). Nothing was written.
* :class:`AuditSigningKeyError` -- the signing key cannot be used: it does not open with this
  master key, or its stored public half does not match the private half.
* :class:`AuditChainError` -- the database disagrees with itself about a chain (for example a
  checkpoint asked for a chain that has no records).
* :class:`AuditVerificationError` -- raised only on request
  (:meth:`~tenantkv.audit.verify.VerifyReport.raise_if_invalid`); :func:`verify_export` itself
  reports problems and never raises.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base class of every error raised by ``tenantkv.audit``."""


class AuditRequestError(AuditError, ValueError):
    """A malformed event or export request; nothing was written."""


class AuditSigningKeyError(AuditError):
    """The checkpoint signing key is unusable (wrong master key, or its halves disagree)."""


class AuditChainError(AuditError):
    """A chain is missing or inconsistent in the database."""


class AuditVerificationError(AuditError):
    """An export failed verification; ``problems`` lists why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"audit export failed verification: {shown}{more}")
