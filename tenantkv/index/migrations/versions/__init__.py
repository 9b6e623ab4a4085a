"""The revisions, oldest first: the milestone-1 baseline, the fleet tables (issue 12), then the
identity and audit-integrity columns (issue 13). Alembic does not import this file."""
