"""The worker half of the connector: loads cached prefixes into vLLM's paged KV, layer by
layer, and saves computed prompts from it.

* **Layer-wise loads** (the default): ``start_load_kv`` opens a tenantkv load stream per request
  (reading and decrypting start at once, in the background); ``wait_for_layer_load(name)``,
  called by each attention layer before it runs, takes that layer from every stream and writes
  it into the request's pages, so layer ``i`` computes while layers ``i + 1 ...`` are read.
* **Loads before the forward** (``layer_wise=False``, or ``"auto"`` on vLLM's CPU backend):
  ``start_load_kv`` loads each request's every layer into its pages and returns; the layer
  hooks have nothing left to do. Where the forward computes on every CPU, a load streamed
  into it only takes CPUs from the model's threads (``forward_takes_every_cpu``).
* **Async loads** (``load_async``): the whole load runs on a background thread between steps;
  ``get_finished`` reports the request once every layer is in its pages.
* **Saves** leave the forward step: ``save_kv_layer`` only notes each layer's pages, and
  ``wait_for_save`` queues the request's save (``saves.BackgroundSaves``: one thread gathers the
  new blocks' rows from the pages and stores them through ``Namespace.store(start=)``). vLLM
  keeps the pages until the save is done: a finished request's through ``delay_free_blocks``
  and ``get_finished`` (finished sending), a preempted one's through ``handle_preemptions``,
  which waits for its save before the next step may overwrite them. The queue is bounded in
  bytes (back-pressure on the step).
* **The engine's layout, read once**: ``register_kv_caches`` views and checks each layer's
  pages once (:class:`~tenantkv.integrations.paged_kv.PagedLayer`; pages that do not match the
  layout are refused there, with InvalidRequestError); a step that hands other page tensors
  has them checked once at ``start_load_kv``. Each request's pages are worked out once
  (:class:`~tenantkv.integrations.paged_kv.RequestBlocks`: runs of consecutive pages, or one
  index tensor) when its load starts or its save is queued, and reused by every layer.
* **Straight into the pages**: where the pages hold a layer's rows as tenantkv stores them
  (MLA: ``[blocks, tokens, latent]``; MHA/GQA, stored as the pages themselves: layout kind
  ``mha-pages``), the pages are the load's ``out=`` buffers (``block_rows``: each block's
  first row): the load decrypts into them in the background, with no layer tensor and no copy;
  ``wait_for_layer_load`` only waits. Blocks vLLM's own prefix cache already holds are not
  loaded at all (``Namespace.load(skip_blocks=)``): their pages may be shared with other
  requests, and decrypting them would be thrown away. Otherwise (pages that do not hold the
  rows as stored) each layer is copied once (a slice per run of pages, or one indexed copy).
* **Failures**: a load that finds its prefix gone, a segment that fails to open (a security
  event, the extent dropped), a revoked key or an I/O error: the request's loaded pages are
  reported by ``get_block_ids_with_load_errors`` and vLLM recomputes them (run vLLM with
  ``kv_load_failure_policy="recompute"``). Never wrong data, never a failed request. A failed
  save is counted (``BackgroundSaves.failed``, the ``engine_errors`` health counter) and
  leaves nothing indexed; the next request simply misses.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ...datapath.loader import LoadStream
from ...errors import InvalidRequestError, TenantKVError
from ...host_cpus import usable_cpu_count
from ...layout import KVLayout, Layer
from ...openmp_threads import pool_initializer
from ..engine_identity import EngineNamespaces
from ..paged_kv import PagedLayer, RequestBlocks
from .metadata import LoadSpec, TenantKVConnectorMetadata, TenantKVWorkerMetadata
from .saves import DEFAULT_MAX_PENDING_BYTES, BackgroundSaves, SaveJob

logger = logging.getLogger("tenantkv")


def forward_takes_every_cpu(pages: list[torch.Tensor]) -> bool:
    """Whether the engine's forward computes on every CPU a load could run on: its pages are
    in host memory (vLLM's CPU backend: the model runs on the CPUs) and torch's thread count,
    the forward's OpenMP team, is at least the CPUs the process can keep busy.

    Then a load that streams into the forward has nothing to overlap with: each of its threads
    takes a CPU from a member of the team, and the whole team waits for that member at the end
    of every parallel region, so the forward loses more than the load's CPU time. Loading the
    whole prefix before the forward costs the load's CPU time alone. On a GPU, or where the
    team leaves CPUs free, layer ``i`` computes while layers ``i + 1 ...`` are read."""
    if not pages or any(p.device.type != "cpu" for p in pages):
        return False
    return torch.get_num_threads() >= usable_cpu_count()


@dataclass
class _Load:
    spec: LoadSpec
    stream: LoadStream | None
    blocks: RequestBlocks  # the pages blocks first_block.. go to, worked out once
    direct: bool  # the stream writes the pages itself (no copy here)
    written: int = 0  # layers written into the pages


@dataclass
class _Failures:
    """Pages whose load failed, until vLLM asks (once per step)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    block_ids: set[int] = field(default_factory=set)

    def add(self, spec: LoadSpec, err: BaseException) -> None:
        logger.warning(
            "tenantkv load for request %s failed, vLLM recomputes it: %s", spec.request_id, err
        )
        with self.lock:
            self.block_ids.update(spec.block_ids[spec.first_block :])

    def take(self) -> set[int]:
        with self.lock:
            taken, self.block_ids = self.block_ids, set()
        return taken


class WorkerSide:
    def __init__(
        self,
        engine: EngineNamespaces,
        layer_names: list[str],
        *,
        max_pending_save_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        layer_wise: bool | None = True,
    ) -> None:
        self._engine = engine
        #: the setting (None: decided from the pages at register_kv_caches)
        self._layer_wise_setting = layer_wise
        #: whether a synchronous load streams into the forward (else it is whole before it)
        self._layer_wise = layer_wise is not False
        self._layout: KVLayout = engine.layout
        self._layer_names = list(layer_names)
        self._layer_index = {name: i for i, name in enumerate(layer_names)}
        #: each layer's pages, viewed and checked once (register_kv_caches, or a step's own)
        self._paged: dict[str, PagedLayer] = {}
        #: layers whose step handed pages that do not match the layout (their loads fail)
        self._refused: dict[str, InvalidRequestError] = {}
        self._loads: list[_Load] = []
        self._save_pages: list[torch.Tensor | None] = [None] * len(layer_names)
        self.saves = BackgroundSaves(engine, max_bytes=max_pending_save_bytes)
        self._with_saves: set[str] = set()  # requests given a save (their pages are held)
        self._finished_saving: set[str] = set()  # finished requests whose saves still run
        self._failures = _Failures()
        self._async_pool = ThreadPoolExecutor(  # its kernels on itself alone: openmp_threads.py
            1, thread_name_prefix="tenantkv-vllm-load", initializer=pool_initializer()
        )
        self._finished_lock = threading.Lock()
        self._finished_loads: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """View and check every attention layer's pages once. Pages that do not match the
        layout raise InvalidRequestError here, at startup, rather than fail every load."""
        self._paged = {
            name: PagedLayer(pages, self._layout)
            for name, pages in kv_caches.items()
            if name in self._layer_index
        }
        self._refused.clear()
        if self._layer_wise_setting is None:
            pages = [paged.pages for paged in self._paged.values()]
            self._layer_wise = not forward_takes_every_cpu(pages)

    def _use_pages(self, caches: dict[str, Any]) -> None:
        """A step's own page tensors: the registered views are kept where they are the same
        memory (the usual case); other tensors are viewed and checked once, here. A layer whose
        pages are refused has its loads fail (reported, recomputed), not the step."""
        for name, pages in caches.items():
            if name not in self._layer_index:
                continue
            known = self._paged.get(name)
            if known is not None and known.same_pages(pages):
                continue
            try:
                self._paged[name] = PagedLayer(pages, self._layout)
                self._refused.pop(name, None)
            except InvalidRequestError as err:
                self._paged.pop(name, None)
                self._refused[name] = err

    def _pages_of(self, layer_name: str) -> PagedLayer:
        paged = self._paged.get(layer_name)
        if paged is None:
            raise self._refused.get(layer_name) or InvalidRequestError(
                f"the engine registered no KV cache for layer {layer_name}"
            )
        return paged

    # ---- loads --------------------------------------------------------------------------------

    def _load_blocks(self, spec: LoadSpec) -> RequestBlocks:
        """The pages a load fills (blocks the engine already has are skipped), checked against
        every layer's pages: InvalidRequestError for a request whose pages lie outside them."""
        blocks = RequestBlocks(spec.block_ids[spec.first_block :])
        for name in self._layer_names:
            self._pages_of(name).check_blocks(blocks)
        return blocks

    def _direct_target(self, blocks: RequestBlocks) -> tuple[list[torch.Tensor], list[int]] | None:
        """Every layer's pages as token rows and the first rows of the blocks the load fills
        in them, when the load can decrypt straight into the pages: every layer's rows lie
        there as stored (``PagedLayer.rows``), on one device, in blocks of the namespace's
        size. Blocks the engine already has are not loaded at all (``skip_blocks``): they may
        be shared with other requests."""
        tokens = self._engine.block_tokens
        buffers: list[torch.Tensor] = []
        for name in self._layer_names:
            paged = self._paged.get(name)
            if paged is None or paged.rows is None or paged.block_tokens != tokens:
                return None
            buffers.append(paged.rows)
        if len({buffer.device for buffer in buffers}) != 1:
            return None
        return buffers, blocks.first_rows(tokens)

    def _open(
        self,
        spec: LoadSpec,
        direct: tuple[list[torch.Tensor], list[int]] | None = None,
    ) -> LoadStream | None:
        namespace = self._engine.namespace(spec.owner)
        if namespace is None:
            self._failures.add(spec, LookupError(f"no namespace for {spec.owner}"))
            return None
        tokens, skip = list(spec.token_ids), spec.first_block  # the engine has the first blocks
        try:
            if direct is not None:
                out, rows = direct
                return namespace.load(
                    tokens, out[0].device, out=out, block_rows=rows, skip_blocks=skip
                )
            return namespace.load(tokens, skip_blocks=skip)
        except TenantKVError as err:
            self._failures.add(spec, err)
            return None

    def start_load_kv(
        self, meta: TenantKVConnectorMetadata, forward_caches: dict[str, Any]
    ) -> None:
        """Start this step's loads; ``forward_caches`` maps layer names to their page views."""
        self._use_pages(forward_caches)
        for spec in meta.loads:
            if spec.asynchronous:
                self._async_pool.submit(self._load_whole, spec)
                continue
            try:
                blocks = self._load_blocks(spec)
            except InvalidRequestError as err:
                self._failures.add(spec, err)
                continue
            direct = self._direct_target(blocks)
            if self._layer_wise:
                self._loads.append(
                    _Load(spec, self._open(spec, direct), blocks, direct is not None)
                )
            else:
                self._load_all_layers(spec, blocks, direct)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        for load in self._loads:
            if load.stream is None:
                continue
            try:
                layer = load.stream.wait_for_layer(index)
                if not load.direct:  # else the stream wrote the layer into the pages
                    self._write(load.blocks, layer_name, layer)
                load.written += 1
            except (TenantKVError, RuntimeError) as err:
                self._failures.add(load.spec, err)
                load.stream.close()
                load.stream = None
        if index == len(self._layer_index) - 1:
            self._close_loads()

    def _write(self, blocks: RequestBlocks, layer_name: str, layer: Layer) -> None:
        # the layer holds the blocks after those the engine has (skip_blocks), as ``blocks``
        self._pages_of(layer_name).write(blocks, layer)

    def _load_all_layers(
        self,
        spec: LoadSpec,
        blocks: RequestBlocks,
        direct: tuple[list[torch.Tensor], list[int]] | None,
    ) -> None:
        """Every layer of a load into its pages, now; a failure is reported (recomputed)."""
        stream = self._open(spec, direct)
        if stream is None:
            return
        try:
            with stream:
                for index, layer in stream:
                    if direct is None:  # else the stream wrote the layer into the pages
                        self._write(blocks, self._layer_names[index], layer)
        except (TenantKVError, RuntimeError, KeyError) as err:
            self._failures.add(spec, err)

    def _load_whole(self, spec: LoadSpec) -> None:
        """Background: every layer of an async load into its pages, then report it finished."""
        try:
            blocks = self._load_blocks(spec)
            self._load_all_layers(spec, blocks, self._direct_target(blocks))
        except (TenantKVError, RuntimeError, KeyError) as err:
            self._failures.add(spec, err)
        finally:
            with self._finished_lock:
                self._finished_loads.add(spec.request_id)

    def _close_loads(self) -> None:
        """End this step's loads. One whose layers were not all written (the model skipped
        the hooks, or a layer failed) has its pages reported, so vLLM recomputes them."""
        for load in self._loads:
            if load.stream is not None:
                if load.written < len(self._layer_index):
                    self._failures.add(load.spec, RuntimeError("not every layer was loaded"))
                load.stream.close()
        self._loads.clear()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished loading). A finished request that was given a save
        (``request_finished`` held its pages) is reported once that save is done."""
        with self._finished_lock:
            done, self._finished_loads = self._finished_loads, set()
        self._finished_saving |= finished_req_ids & self._with_saves
        sent = {rid for rid in self._finished_saving if not self.saves.in_flight(rid)}
        self._finished_saving -= sent
        self._with_saves -= sent
        return sent or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._failures.take()

    # ---- saves --------------------------------------------------------------------------------

    def save_kv_layer(
        self, meta: TenantKVConnectorMetadata, layer_name: str, kv_layer: Any
    ) -> None:
        """Note the layer's pages; nothing is copied in the forward step."""
        index = self._layer_index.get(layer_name)
        if index is not None and meta.saves:
            self._save_pages[index] = kv_layer
            # Pages other than the registered ones (a step's own view): checked once, here.
            self._use_pages({layer_name: kv_layer})

    def wait_for_save(self, meta: TenantKVConnectorMetadata | None) -> None:
        """Queue this step's saves (waiting only while the queue is over its byte bound)."""
        self._close_loads()  # a step whose model skipped layers must not keep streams open
        pages, self._save_pages = self._save_pages, [None] * len(self._layer_index)
        if meta is None or not meta.saves:
            return
        ready = None
        if any(p is not None and p.is_cuda for p in pages):
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()  # the step's writes to the pages come before the gather
        paged: list[PagedLayer] = []
        refused: BaseException | None = None
        if any(p is None for p in pages):
            refused = RuntimeError("the model skipped save_kv_layer for a layer")
        else:
            try:
                paged = [self._pages_of(name) for name in self._layer_names]
            except InvalidRequestError as err:
                refused = err
        for spec in meta.saves:
            self._with_saves.add(spec.request_id)  # request_finished holds its pages
            try:
                if refused is not None:
                    raise refused
                blocks = RequestBlocks(spec.block_ids[spec.start_block :])
                for layer in paged:  # refused here: nothing queued, no pages held for it
                    layer.check_blocks(blocks)
            except (InvalidRequestError, RuntimeError) as err:
                self._engine.failed("save", err, request_id=spec.request_id)
                continue
            count = len(blocks)
            nbytes = count * self._engine.block_tokens * self._layout.token_bytes * len(paged)
            self.saves.submit(SaveJob(spec, paged, blocks, nbytes, ready))

    def handle_preemptions(self, meta: TenantKVConnectorMetadata) -> None:
        """Before the step that may overwrite a preempted request's freed pages: finish its
        save from them."""
        if meta.preempted:
            self.saves.wait_for(set(meta.preempted))

    def worker_metadata(self) -> TenantKVWorkerMetadata | None:
        saved = self.saves.take_done()
        return TenantKVWorkerMetadata(saved) if saved else None

    def shutdown(self) -> None:
        self._close_loads()
        self._async_pool.shutdown(wait=True)
        self.saves.shutdown()
