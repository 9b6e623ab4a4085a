"""Cache engineering for agents: drop token spans from a cached prefix, reposition the rest.

* :mod:`.script`: edit scripts (data: which spans to drop).
* :mod:`.rope`: moving RoPE-rotated keys to new positions (an exact rotation).
* :mod:`.apply`: an edit script applied to a prefix's layers (only keys move).
* :mod:`.lineage`: the edited prefix's place (its own key chain in the namespace).
* :mod:`.policies`: which spans an agent's transcript drops (pluggable).

Storing, loading and editing in the store go through ``Namespace`` (``origin=``) and
``tenantkv.services.editing``; the transformers integration edits restored caches.
"""

from .apply import edit_layer, edit_layers
from .lineage import EditedPrefix
from .policies import DropOldToolOutputs, EditPolicy, KeepEverything, Segment
from .rope import RopeSpec, rotate_to
from .script import EditScript

__all__ = [
    "DropOldToolOutputs",
    "EditPolicy",
    "EditScript",
    "EditedPrefix",
    "KeepEverything",
    "RopeSpec",
    "Segment",
    "edit_layer",
    "edit_layers",
    "rotate_to",
]
