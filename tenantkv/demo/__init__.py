"""``tenantkv demo``: the README's main job, end to end on the embedded default.

Two tenants of one cache serve an agent conversation with a small, randomly initialised
DeepSeek-V3-style transformers model (no download): the first turn misses and is saved, the
next turn restores its prefix from the encrypted store, and the other tenant's identical request
misses. Every claim the demo prints is computed while it runs (see :mod:`.run`).
"""

from .run import DemoReport, run_demo

__all__ = ["DemoReport", "run_demo"]
