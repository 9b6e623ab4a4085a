"""Edited prefixes as values: which key chain an edited cache lives on.

An edited prefix shares its parent's blocks up to the first block the edit touches, then continues
on a key chain of its own, bound, under the namespace key, to the parent's last block key and the
edit script (``tenantkv.prefix``). The caller keeps the
:class:`EditedPrefix` a namespace gave it (an agent session keeps it between turns) and passes it
to ``lookup``/``store``/``load`` with the edited token sequence; the next turn's tokens extend the
same chain, like any prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EditedPrefix:
    """Where an edited prefix's keys lie, in one namespace. Opaque: the binding is derived from
    the namespace's secret key and never leaves the process (it is not in ``repr``)."""

    namespace_id: bytes = field(repr=False)
    #: The keyed digest of (parent's last block key, edit script).
    binding: bytes = field(repr=False)
    #: The prefix this one was edited from (None: an unedited prefix).
    parent: EditedPrefix | None = field(repr=False)
    #: Leading blocks the edit does not touch: keyed, and stored, as the parent's.
    shared_blocks: int = 0
    #: How many edits lie between the unedited prefix and this one (1 for a first edit).
    depth: int = 1
    #: Tokens dropped from the cached part by this edit and its ancestors.
    dropped_tokens: int = 0
