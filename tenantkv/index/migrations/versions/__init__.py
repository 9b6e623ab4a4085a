"""The revisions, oldest first: the milestone-1 baseline, the fleet tables (issue 12), the
identity and audit-integrity columns (issue 13), the blocks' index by extent and slot
(issue 16), then the inference keys' table (issue 34). Alembic does not import this file."""
