"""Edited prefixes as values: which key chain an edited cache lives on.

An edited prefix is addressed by a seed derived, under the namespace key, from its parent's last
block key and the edit script (``tenantkv.prefix.edit_seed``). The caller keeps the
:class:`EditedPrefix` a namespace gave it (an agent session keeps it between turns) and passes it
to ``lookup``/``store``/``load`` with the edited token sequence; the next turn's tokens extend the
same chain, like any prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..prefix import EditSeed


@dataclass(frozen=True)
class EditedPrefix:
    """Where an edited prefix's keys start, in one namespace. Opaque: the seed is derived from
    the namespace's secret key and never leaves the process (it is not in ``repr``)."""

    namespace_id: bytes = field(repr=False)
    seed: EditSeed = field(repr=False)
    #: How many edits lie between the unedited prefix and this one (1 for a first edit).
    depth: int = 1
    #: Tokens dropped from the cached part by this edit and its ancestors.
    dropped_tokens: int = 0
