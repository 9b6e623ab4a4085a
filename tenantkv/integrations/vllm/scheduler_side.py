"""The scheduler half of the connector: how many tokens a request finds cached, and what the
worker must load and save each step.

``get_num_new_matched_tokens`` is asked again and again for a waiting request, so it is side
effect free: the assertion is verified once per request (a refusal records one security event,
not one per poll) and the length comes from ``Namespace.cached_length``, which does not meter.
Metering happens once, when the request finishes (``Namespace.record_request``), with the
tokens really served: a load that failed counts as a miss.

Nothing here raises into vLLM's scheduler, whose step serves every tenant's requests: an error
of the cache (a token id out of range, an index outage, a closed cache) gives the request no
cache -- computed as without a connector, nothing loaded or saved -- and is counted
(``EngineNamespaces.failed``).

Saves run in the background on the worker (``worker_side``). A waiting request whose prompt
shares blocks with a prompt still being saved for the same owner, beyond what vLLM's own prefix
cache already gave it, is answered "not yet" (``None``: vLLM asks again next step) until the
worker reports that save done, so a conversation's next turn loads what its previous turn stored
instead of computing it again. A request whose local hit already covers what the save would add
(vLLM's prefix cache holds the previous turn's pages, its usual case right after a turn) never
waits. A save the worker never reports (a lost worker) stops holding lookups after
``SAVE_WAIT_LIMIT`` seconds. ``request_finished`` holds the pages of a request given a save
until the worker reports it finished sending.

A step that schedules nothing while a request waits on the connector's background work (held
for a save, or an asynchronous load not yet finished) sleeps ``BACKGROUND_YIELD`` before it
returns. Where vLLM's engine core runs in the caller's process (``LLM`` in a script), its loop
steps again at once while a request waits, holding the GIL between steps, and the background
thread -- which releases the GIL at every seal, read, write and index statement -- waits a whole
switch interval (5 ms) to take it back each time: a 2,048-token save took 1.7-3.7 s instead of
~0.1 (docs/perf.md, "vLLM: the hit right after its miss, and the GIL"). The sleep gives the GIL
to that work while there is nothing else to run, as vLLM's own engine core does after an idle
step where it runs in processes of its own.

The prompt's last token is never reported as cached (vLLM must compute at least one token), and
hits are whole blocks: the namespace's block size is vLLM's ``block_size``, so tenantkv's
blocks and vLLM's pages coincide.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ...services.namespace import Namespace
from ..engine_identity import ENGINE_FAILURES, EngineNamespaces, RequestTenant
from .metadata import LoadSpec, SaveSpec, TenantKVConnectorMetadata, TenantKVWorkerMetadata

logger = logging.getLogger("tenantkv")

#: Seconds a lookup waits at most for a save of the same prefix the worker has not reported.
SAVE_WAIT_LIMIT = 30.0

#: Seconds an idle step sleeps while a request waits on a save or an asynchronous load, giving
#: the GIL to that work (see the module docstring; vLLM's engine core sleeps as long after an
#: idle step).
BACKGROUND_YIELD = 0.001


@dataclass(frozen=True)
class _PendingSave:
    """A save handed to the worker and not reported done: its owner, the tokens it covers (the
    prompt's full blocks) and when it was handed over."""

    owner: RequestTenant
    tokens: tuple[int, ...]
    since: float


@dataclass
class _Tracked:
    """What the scheduler side knows about one live request."""

    owner: RequestTenant | None
    namespace: Namespace | None
    prompt: tuple[int, ...]
    cached: int = 0  # tokens tenantkv had at the last lookup
    local_hit: int = 0  # tokens vLLM's own prefix cache had at the last lookup
    block_ids: list[int] = field(default_factory=list)
    loaded_blocks: set[int] = field(default_factory=set)
    external_tokens: int = 0
    load_failed: bool = False
    saved: bool = False
    save_sent: bool = False  # a SaveSpec went to the worker: its pages are held at the end


class SchedulerSide:
    def __init__(self, engine: EngineNamespaces, block_tokens: int, load_async: bool) -> None:
        self._engine = engine
        self._block = block_tokens
        self._async = load_async
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_saves: dict[str, _PendingSave] = {}
        self._held_for_save = False  # this step answered "not yet" for a pending save
        self._loading_async: set[str] = set()  # asynchronous loads not reported finished

    def _save_pending_for(self, tracked: _Tracked, num_computed_tokens: int) -> bool:
        """Whether a save the worker has not finished would give this prompt at least one
        usable block past the ``num_computed_tokens`` vLLM already has: the save covers the
        prompt's blocks up to and including the first block past them."""
        now = time.monotonic()
        usable = (len(tracked.prompt) - 1) // self._block * self._block
        wanted = (num_computed_tokens // self._block + 1) * self._block
        if wanted > usable:
            return False  # vLLM already has every block a hit could give
        head = tracked.prompt[:wanted]
        for rid, pending in list(self._pending_saves.items()):
            if now - pending.since > SAVE_WAIT_LIMIT:
                logger.warning("tenantkv save of request %s not reported; lookups go on", rid)
                del self._pending_saves[rid]
            elif pending.owner == tracked.owner and pending.tokens[:wanted] == head:
                return True
        return False

    def _track(self, request: Any) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            try:
                found = self._engine.resolve(
                    request.kv_transfer_params, request_id=request.request_id
                )
            except ENGINE_FAILURES as err:
                self._engine.failed("resolve", err, request_id=request.request_id)
                found = None
            owner, namespace = found if found is not None else (None, None)
            tracked = _Tracked(owner, namespace, tuple(request.prompt_token_ids or ()))
            self._requests[request.request_id] = tracked
        return tracked

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if tracked.namespace is None or len(tracked.prompt) < 2:
            return 0, False
        if self._pending_saves and self._save_pending_for(tracked, num_computed_tokens):
            self._held_for_save = True
            return None, False  # asked again next step, once the save is indexed
        # Look the prompt's full blocks up (so a later save knows what is cached), but never
        # report the block holding the last prompt token: vLLM must compute at least one.
        full = len(tracked.prompt) // self._block * self._block
        usable = (len(tracked.prompt) - 1) // self._block * self._block
        try:
            tracked.cached = tracked.namespace.cached_length(list(tracked.prompt[:full]))
        except ENGINE_FAILURES as err:
            self._engine.failed("lookup", err, request_id=request.request_id)
            # no cache for this request from now on: nothing to load, nothing to save
            tracked.owner, tracked.namespace, tracked.cached = None, None, 0
            return 0, False
        new = min(tracked.cached, usable) - num_computed_tokens
        if new <= 0:
            return 0, False
        tracked.local_hit = num_computed_tokens
        return new, self._async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        tracked = self._track(request)
        assert tracked.owner is not None, "a load was granted to a request without an owner"
        block_ids = list(blocks.get_block_ids()[0])
        # The external tokens follow vLLM's local hit, the one the lookup was given: vLLM sets
        # the request's num_computed_tokens only after this call (0 here for a new request), so
        # counting from it put the load over the shared local pages and left the last pages
        # unfilled whenever vLLM's prefix cache held the prompt's first blocks.
        end = tracked.local_hit + num_external_tokens
        first, last = tracked.local_hit // self._block, end // self._block
        tracked.external_tokens = num_external_tokens
        tracked.loaded_blocks = set(block_ids[first:last])
        if self._async:
            self._loading_async.add(request.request_id)
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id,
            tracked.owner,
            tracked.prompt[:end],
            tuple(block_ids[:last]),
            first,
            self._async,
        )

    def build_connector_meta(self, scheduler_output: Any) -> TenantKVConnectorMetadata:
        waiting = self._held_for_save or bool(self._loading_async)
        self._held_for_save = False
        if waiting and not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            time.sleep(BACKGROUND_YIELD)  # nothing to run: let the background work have the GIL
        meta = TenantKVConnectorMetadata(
            loads=list(self._pending_loads.values()),
            preempted=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        )
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._maybe_save(
                meta, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id]
            )
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            self._maybe_save(meta, req_id, tracked, computed)
        return meta

    def _maybe_save(
        self, meta: TenantKVConnectorMetadata, req_id: str, tracked: _Tracked, computed: int
    ) -> None:
        """Save the prompt's full blocks in the step that computes the last of them."""
        full = len(tracked.prompt) // self._block * self._block
        if tracked.owner is None or tracked.saved or full == 0 or computed < full:
            return
        tracked.saved = True
        start = min(tracked.cached, full) // self._block
        if start * self._block >= full:
            return  # all cached already
        tracked.save_sent = True
        tokens = tracked.prompt[:full]
        self._pending_saves[req_id] = _PendingSave(tracked.owner, tokens, time.monotonic())
        meta.saves.append(
            SaveSpec(
                req_id,
                tracked.owner,
                tokens,
                tuple(tracked.block_ids[: full // self._block]),
                start,
            )
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Note the saves the worker finished, and requests whose loaded blocks failed (vLLM
        recomputes them): a miss to meter."""
        self._loading_async.difference_update(
            getattr(connector_output, "finished_recving", None) or ()
        )
        worker = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker, TenantKVWorkerMetadata):
            for rid in worker.saved:
                self._pending_saves.pop(rid, None)
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        for tracked in self._requests.values():
            if tracked.loaded_blocks & invalid:
                # vLLM recomputes the prompt; the cached copy was dropped (or is unreadable),
                # so the recomputed blocks are saved again
                tracked.load_failed = True
                tracked.cached = 0
                tracked.saved = False

    def request_finished(self, request: Any) -> bool:
        """Meter the request; True (hold its pages) if the worker was given its save."""
        tracked = self._requests.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._loading_async.discard(request.request_id)
        if tracked is None or tracked.namespace is None:
            return tracked is not None and tracked.save_sent
        hit = 0 if tracked.load_failed else tracked.external_tokens
        try:
            tracked.namespace.record_request(hit, max(0, len(tracked.prompt) - hit))
        except Exception as err:  # metering must never fail the engine
            logger.warning("could not meter request %s: %s", request.request_id, err)
        return tracked.save_sent
