"""An opt-in policy: loader workers hold back for a caller blocked on layer 0 (off by default).

With it, from the moment layer 0's last chunk is taken while the caller is blocked on layer 0,
a worker opens no chunk of a later layer, and one already opening such a chunk pauses before
its next group of ``segments`` segments, until the caller has layer 0 and comes back for another
layer (or closes the stream); at most ``tail_s`` until layer 0 completes, and ``handover_s``
after, and not while another task waits for a loader thread (a held worker keeps its thread).

Why it exists: with one worker per core busy, a woken caller otherwise waits for a core (Linux
queues it behind a worker pinned there, or a worker it wakes takes its core back) and then for
the GIL, which the workers release and take back around every segment, winning the race for it
again and again (docs/perf.md, "The woken caller's core"). Why it is off: on the 2-core
development VMs it saved about 0.3 ms of a first layer already ~10x earlier than the peer's;
with a caller that computes between layers, and inside vLLM, the effect was within noise, and
nothing shows it helps on more cores. Turn it on with
``CacheConfig.hold_workers_for_first_layer``.

The decisions are pure (times are passed in); the workers' side of the stream
(``load_workers.py``) keeps the deadline under its lock and does the waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The longest workers are held for a caller blocked on layer 0 from the moment its last chunk
#: is taken (seconds): that chunk's read and decryption, ~1 ms at 8K DeepSeek-V3 tokens.
FIRST_LAYER_TAIL_S = 0.002
#: The longest workers are held after layer 0 completed for a caller blocked on it (seconds),
#: unless it comes back for another layer sooner: time for it to wake and take the layer
#: (~0.1 ms measured). A caller that goes on to work of its own (an engine copying the layer
#: into its pages) has the workers back after this; held for 2 ms, vLLM's hits took ~2 ms
#: longer (docs/perf.md).
FIRST_LAYER_HANDOVER_S = 0.0005
#: Segments a worker opens between looks at whether a caller woken for layer 0 waits for the
#: GIL (16 segments of 64 DeepSeek-V3 tokens: ~1.2 MB, ~0.1 ms of decryption). Each segment's
#: decryption releases the GIL and takes it back microseconds later, so a woken caller loses the
#: race for it again and again, and the interpreter's forced switch never comes (the lock
#: changes hands all the time): on 2 cores that cost the first layer 0.5-0.9 ms at the median.
HANDOVER_SEGMENTS = 16


@dataclass(frozen=True, slots=True)
class FirstLayerHold:
    """When workers hold back for a caller blocked on layer 0, and for how long.

    A hold is a deadline (``time.monotonic()`` seconds) or ``None`` (workers are free).
    """

    tail_s: float = FIRST_LAYER_TAIL_S
    handover_s: float = FIRST_LAYER_HANDOVER_S
    segments: int = HANDOVER_SEGMENTS

    def after_take(
        self, *, layer: int, index: int, first_chunks: int, waiting_for: int, now: float
    ) -> float | None:
        """Chunk ``index`` of ``layer`` was just taken: if it is layer 0's last and the caller
        is blocked on layer 0, the caller is next: hold until ``now + tail_s``."""
        if layer == 0 and index == first_chunks - 1 and waiting_for == 0:
            return now + self.tail_s
        return None

    def before_wait(self, *, index: int, first_layer_taken: bool, now: float) -> float | None:
        """The caller blocks on layer ``index``: if that is layer 0 and its chunks are all
        taken, it is next: hold until ``now + tail_s``."""
        if index == 0 and first_layer_taken:
            return now + self.tail_s
        return None

    def after_complete(self, *, layer: int, waiting_for: int, now: float) -> float | None:
        """``layer`` completed: if it is layer 0 and the caller is blocked on it, hold until
        ``now + handover_s``, time for it to wake and take the layer."""
        if layer == 0 and waiting_for == 0:
            return now + self.handover_s
        return None

    def ends(self, index: int) -> bool:
        """The caller asks for layer ``index``: a later layer than 0 means it has layer 0."""
        return index > 0

    def pause_s(
        self, *, layer: int, held_until: float | None, now: float, waiting_tasks: int
    ) -> float:
        """How long a worker about to open (more of) a chunk of ``layer`` waits, at most, before
        it looks again; 0: go on. Layer 0 never waits, nor does a worker whose thread other
        tasks wait for."""
        if layer == 0 or held_until is None or waiting_tasks > 0:
            return 0.0
        return max(0.0, held_until - now)
