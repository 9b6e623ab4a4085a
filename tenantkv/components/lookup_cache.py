"""The keys a node's lookups found present, per namespace: a cache of the index, never the truth.

A 128K-token lookup asks about 2,048 block keys. Asking the index for all of them costs
milliseconds (``IN`` lists of 500 keys; docs/perf.md, "Lookup"), so each node keeps the keys
its lookups found, with the expiry time of each key's extent, and a later lookup asks the index
one statement only (``index.blocks.check_lookup``): the namespace's removal counter
(``index.removals``), and whether the first key past the held run is present.

* **Never a hit the index would not give.** Held keys are trusted only while the namespace's
  removal counter is the value read before them (every removal of blocks -- eviction, GC,
  purge, re-sealing, a damaged or lost extent, changed retention -- adds one, on whichever node
  it happens) and only until their expiry time. A lookup that finds the counter moved drops
  the namespace's keys and asks the index about every key. A key's expiry here is never later
  than in the index: loads only push expiry times later, and whatever moves them earlier
  counts a removal. Between a lookup and a load another node may still remove blocks, as
  before: the load then misses (``CacheMissError``) as it always did.
* **Misses are never held.** New blocks, stored by any node, are seen at once: the one
  statement asks the index about the first key the node does not hold.
* **Per namespace, strictly.** Keys are held in one dictionary per namespace id and a lookup
  reads only its own namespace's; block keys are keyed hashes (``tenantkv.prefix``), so equal
  keys in two namespaces could not even mean equal tokens.
* **Bounded memory.** At most ``max_keys`` keys in all (``CacheConfig.lookup_cache_keys``,
  default 262,144: 128 prompts of 128K tokens). Each costs about 100 bytes in CPython (a
  32-byte ``bytes`` object, a dictionary slot, its share of a float; tracemalloc: 25 MiB for
  262,144 keys). When a namespace's new keys would exceed the bound, the least recently looked-up
  namespaces are dropped whole; a namespace that alone exceeds it keeps only the latest keys
  found. Dropping only makes that namespace's next lookup ask the index about every key: which
  namespaces are dropped depends on how many keys others hold, never on which prefixes.

Thread-safe: lookups read a namespace's dictionary while another thread adds to it (single
dictionary operations are atomic in CPython); replacing and dropping happen under a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat


@dataclass(frozen=True)
class HeldKeys:
    """The keys held for one namespace, read under removal counter ``removals``."""

    removals: int
    #: Block key -> expiry time of its extent when it was read (never later than the index's).
    expires: dict[bytes, float] = field(default_factory=dict)

    def run(self, keys: Sequence[bytes], now: float) -> int:
        """How many of ``keys``, from the first, are held and unexpired at ``now``."""
        expiries = list(map(self.expires.get, keys, repeat(0.0)))  # 0.0: not held
        if not expiries or min(expiries) > now:  # the common case, found in C
            return len(expiries)
        for count, expires_at in enumerate(expiries):
            if expires_at <= now:
                return count
        raise AssertionError("unreachable: min() found an expired key")  # pragma: no cover


class LookupCache:
    """Held keys of every namespace a node looked up recently (see the module docstring)."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 0:
            raise ValueError("max_keys must not be negative")
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._namespaces: OrderedDict[bytes, HeldKeys] = OrderedDict()
        self._count = 0

    def held(self, namespace_id: bytes) -> HeldKeys | None:
        """The keys held for the namespace (None: none), marking it as recently used."""
        with self._lock:
            held = self._namespaces.get(namespace_id)
            if held is not None:
                self._namespaces.move_to_end(namespace_id)
            return held

    def add(self, namespace_id: bytes, removals: int, found: Mapping[bytes, float]) -> None:
        """Hold ``found`` (key -> expiry), read from the index after the namespace's removal
        counter was read as ``removals``.

        Keys held under another counter value are dropped first (a removal happened in
        between). Keys read under an older value than those held are not added: another
        lookup already saw a later removal."""
        if self.max_keys == 0:
            return
        with self._lock:
            held = self._namespaces.get(namespace_id)
            if held is not None and held.removals > removals:
                return
            if held is None or held.removals != removals:
                if held is not None:
                    self._count -= len(held.expires)
                held = HeldKeys(removals)
                self._namespaces[namespace_id] = held
            self._namespaces.move_to_end(namespace_id)
            expires = held.expires
            before = len(expires)
            expires.update(found)
            self._count += len(expires) - before
            self._bound(namespace_id, found)

    def forget(self, namespace_id: bytes) -> None:
        """Drop everything held for the namespace."""
        with self._lock:
            held = self._namespaces.pop(namespace_id, None)
            if held is not None:
                self._count -= len(held.expires)

    def clear(self) -> None:
        with self._lock:
            self._namespaces.clear()
            self._count = 0

    def size(self) -> tuple[int, int]:
        """(namespaces, keys) held now."""
        with self._lock:
            return len(self._namespaces), self._count

    def _bound(self, namespace_id: bytes, found: Mapping[bytes, float]) -> None:
        """Drop least recently used namespaces until ``max_keys`` holds (the lock is held)."""
        while self._count > self.max_keys and len(self._namespaces) > 1:
            oldest, held = next(iter(self._namespaces.items()))
            if oldest == namespace_id:  # the namespace just used is the most recent one
                break  # pragma: no cover - move_to_end above makes this unreachable
            del self._namespaces[oldest]
            self._count -= len(held.expires)
        if self._count <= self.max_keys:
            return
        # This namespace alone is over the bound: keep only what was just found, if it fits.
        held = self._namespaces.pop(namespace_id)
        self._count -= len(held.expires)
        if len(found) <= self.max_keys:
            kept = HeldKeys(held.removals, dict(found))
            self._namespaces[namespace_id] = kept
            self._count += len(kept.expires)
