"""Background saves for the vLLM worker: a prompt's pages are stored after the forward step,
off its critical path, while vLLM keeps the pages.

Why the pages and not a copy: copying every new row out of the pages inside the forward step
is a full pass over the prompt's KV on the step's critical path (and on a GPU a device-to-host
copy the model waits for). vLLM's connector API lets a connector keep the pages instead:

* a *finished* request's pages stay allocated while ``request_finished`` answered
  ``delay_free_blocks=True``, until ``get_finished`` reports the request as finished sending;
* a *running* request never rewrites its prompt's full pages;
* a *preempted* request's pages are freed without asking the connector, so before the next
  forward step (which may overwrite them) ``handle_preemptions`` waits for that request's save.

A save is one job on one thread: gather the new blocks' rows from each layer's pages (on a GPU
after the step's event, so the rows are the ones the step wrote), then ``Namespace.store``,
which writes the extent before it indexes it: a failed save leaves nothing visible, and the next
request simply misses. Failures are counted (``failed``, and the engine's ``engine_errors``
health counter).

Back-pressure: ``submit`` blocks the step while the queued saves hold more than ``max_bytes``
of KV (held pages, and the host copy of the save being stored), so a burst of long prompts
cannot hold the engine's pages or the host's memory without bound; a single save larger than
the bound still runs, alone.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import TenantNotFoundError
from ...openmp_threads import use_one_openmp_thread
from ..engine_identity import ENGINE_FAILURES, EngineNamespaces
from ..paged_kv import PagedLayer, RequestBlocks
from .metadata import SaveSpec

logger = logging.getLogger("tenantkv")

#: Default bound on the KV bytes of queued saves (see the module docstring). 1 GiB holds about
#: fourteen 1K-token DeepSeek-V3 prompts (70 MB each) or one 14K-token prompt before a step
#: waits; a production host with a GPU keeps far more pages than that.
DEFAULT_MAX_PENDING_BYTES = 1 << 30


@dataclass(frozen=True)
class SaveJob:
    """One request's save: its spec, each layer's pages (the memory vLLM keeps, viewed and
    checked once), the request's new blocks in them (worked out once for every layer), the
    bytes it covers, and on a GPU the event after which the step's writes are visible."""

    spec: SaveSpec
    pages: Sequence[PagedLayer]
    blocks: RequestBlocks
    nbytes: int
    ready: Any = None  # torch.cuda.Event on a GPU, None on the CPU


class BackgroundSaves:
    """A queue of save jobs run by one thread, bounded by bytes."""

    def __init__(
        self,
        engine: EngineNamespaces,
        *,
        max_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        store: Callable[[SaveJob], None] | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._engine = engine
        self.max_bytes = max_bytes
        self._store = store or self._store_job
        self._cond = threading.Condition()
        self._queue: deque[SaveJob] = deque()
        self._in_flight: dict[str, int] = {}  # request id -> queued or running jobs
        self._pending_bytes = 0
        self._done: set[str] = set()  # saved (or failed) since the last take_done
        self._closed = False
        #: saves that raised (counted once each; their requests simply miss later)
        self.failed = 0
        #: saves stored (whether or not they found new blocks)
        self.completed = 0
        #: the most KV bytes queued at once (what back-pressure bounds)
        self.peak_pending_bytes = 0
        self._thread = threading.Thread(target=self._run, name="tenantkv-vllm-save", daemon=True)
        self._thread.start()

    # ---- the step's side ----------------------------------------------------------------------

    def submit(self, job: SaveJob) -> None:
        """Queue ``job``; wait first while the queue holds ``max_bytes`` or more."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the background saves are shut down")
            while self._pending_bytes and self._pending_bytes + job.nbytes > self.max_bytes:
                self._cond.wait()
            self._queue.append(job)
            rid = job.spec.request_id
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
            self._pending_bytes += job.nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
            self._cond.notify_all()

    def in_flight(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._in_flight

    def wait_for(self, request_ids: set[str]) -> None:
        """Return once no save of ``request_ids`` is queued or running."""
        with self._cond:
            while request_ids & self._in_flight.keys():
                self._cond.wait()

    def drain(self) -> None:
        """Return once every queued save has run."""
        with self._cond:
            while self._in_flight:
                self._cond.wait()

    def take_done(self) -> set[str]:
        """Requests whose saves finished (stored or failed) since the last call."""
        with self._cond:
            done, self._done = self._done, set()
        return done

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        # Gathering rows and checking them are torch kernels: on this thread alone, so that no
        # OpenMP team of its own slows the engine's forward (openmp_threads.py).
        use_one_openmp_thread()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue[0]
            try:
                self._store(job)
                failed = False
            except (*ENGINE_FAILURES, RuntimeError) as err:
                self._engine.failed("save", err, request_id=job.spec.request_id)
                failed = True
            with self._cond:
                self._queue.popleft()
                self.failed += failed
                self.completed += not failed
                self._pending_bytes -= job.nbytes
                rid = job.spec.request_id
                self._in_flight[rid] -= 1
                if not self._in_flight[rid]:
                    del self._in_flight[rid]
                    self._done.add(rid)
                self._cond.notify_all()

    def _store_job(self, job: SaveJob) -> None:
        """Gather the job's rows from the pages (after the step's event) and store them."""
        spec = job.spec
        namespace = self._engine.namespace(spec.owner)
        if namespace is None:
            raise TenantNotFoundError(f"no namespace for {spec.owner} (deleted or revoked)")
        if job.ready is not None:
            job.ready.synchronize()
        layers = [pages.read(job.blocks) for pages in job.pages]
        namespace.store(
            list(spec.token_ids), layers, start=spec.start_block * self._engine.block_tokens
        )
