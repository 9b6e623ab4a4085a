"""Tamper-evident audit log (hash chains, signed checkpoints, exports). Built in a later issue."""
