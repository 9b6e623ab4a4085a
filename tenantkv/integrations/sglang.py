"""tenantkv as an SGLang HiCache storage backend (extra ``sglang``): per-tenant encrypted pages.

Start SGLang with ``--hicache-storage-backend dynamic`` and the extra config::

    {"backend_name": "tenantkv", "module_path": "tenantkv.integrations.sglang",
     "class_name": "TenantKVHiCacheStorage",
     "root": "/var/lib/tenantkv", "gateway_public_keys": ["/etc/tenantkv/gateway.pub.pem"],
     "assertion_file": "/run/tenantkv/assertion"}

``"codec"`` in the extra config (``"none"``, the default, ``"fp8"`` or ``"int4"``; see
``tenantkv.codecs``) stores pages coded. Under ``"none"`` and ``"fp8"`` a page is one opaque
block, so fp8 scales each page as a whole (e4m3's exponent keeps each value's relative
precision, down to 2^-9 of the page's largest value). ``"int4"`` needs the vectors a page is
made of, because it rotates and scales each vector's channels in groups of 32: every SGLang host
pool layout keeps a token's vector innermost and whole (MHA: one head's ``head_dim`` values of K
or V; MLA: ``kv_lora_rank`` values of ``c_KV`` then ``qk_rope_head_dim`` of ``k_rot``), so a
page is ``N`` such vectors whatever the layout's order of tokens, layers and heads. The backend
reads those sizes from the registered host pool (``head_dim``, or ``kv_lora_rank`` and
``qk_rope_head_dim`` when ``is_mla_model``; the extra config's keys of the same names take
precedence) and stores the page's 16 rows as whole vectors, so the codec sees what it sees in
process: MHA rows of head vectors (each rotated and scaled in groups of ``min(head_dim, 32)``),
MLA rows whose vectors are split into their ``c_KV`` parts (int4, 32-channel groups within one
token's latent when ``kv_lora_rank`` is a multiple of 32) and their ``k_rot`` parts, kept at
fp8 as in process: int4 would triple ``k_rot``'s error to save 32 of 352 bytes a token
(docs/perf.md, "Latent codecs"). That fp8 scale is one per page (all its layers) rather than per
block and layer. A pool whose page is not a whole number of vectors per row (``N`` a multiple
of 16 for MLA, of 32 for MHA, true for the usual page sizes of 16 tokens and more) is refused
with int4 when it is registered. Measured error: docs/engines.md.

**Identity.** SGLang's storage calls carry no request: only page hashes (``keys``) and, at best,
the hashes before them. So the tenant of an SGLang server is its deployment's: a signed tenant
assertion (``tenantkv.tenant_assertion``) that the gateway or a sidecar keeps fresh in
``assertion_file`` (or ``tenantkv_assertion`` in the extra config, for tests), verified with the
configured gateway keys exactly as the vLLM connector verifies a request's. A call's own
``extra_info.extra_info["tenantkv_assertion"]``, when SGLang passes one, takes precedence.
Missing, expired or forged: every call misses (``get`` None, ``exists`` False, ``set`` False)
and one security event is recorded per refused assertion. Nothing SGLang computes or a client
sends selects the tenant.

**Keys.** SGLang's page hash never becomes a key: it is digested into 16 words that tenantkv
treats as one 16-token block and keys with the namespace's secret key (keyed, chained BLAKE2b),
so identical pages of two tenants have unrelated keys and no tenant can address another's.

**Pages.** A page (all its layers, as SGLang's host pool flattens it) is stored as one opaque
one-layer block of its dtype; the namespace's layout records the page's size and dtype, and its
model is SGLang's ``model_name`` (or ``model`` in the extra config). A batch of pages
(``batch_set``, ``batch_set_v1``) is stored as one extent (``Namespace.store_pages``: one
sealing pass, one file, one index transaction), each page still keyed and found on its own;
pages that lie one after the other in the host pool are sealed straight from it.
A batch of loads (``batch_get``, ``batch_get_v1``) is one ``Namespace.load_pages``: one plan of
the pages found, sorted by where they lie, so the pages of one extent are read with one open
and one read pass; a page that is not cached is a miss for itself alone. ``batch_exists`` is
one index read for the batch (``Namespace.cached_pages``). ``batch_get_v1`` and
``batch_set_v1`` move pages between the store and host-pool indices with one copy each way.

**Failures.** A page that fails to open (tampering, corruption; a security event, the extent
dropped) or whose bytes are gone is a miss (``False``/``None``): SGLang recomputes it. Any other
error of the cache (a page of a size it cannot key, an index outage, a closed cache) is a miss
too, counted as an ``engine_errors`` health event and logged at most once a minute per call.
Never an exception into SGLang, never wrong data.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as err:  # a sentence rather than a traceback from the import line
    raise ImportError(
        "tenantkv.integrations.sglang needs SGLang: pip install 'tenantkv[sglang]' "
        "(docs/engines.md)"
    ) from err

from ..codecs import codec
from ..errors import InvalidRequestError, TenantAssertionError, TenantKVError
from ..layout import KVLayout, Layer
from ..services.namespace import Namespace
from ..tenant_assertion import AssertionVerifier, lifetime_setting
from .engine_cache import read_pems, shared_cache
from .engine_identity import (
    ASSERTION_PARAM,
    ENGINE_FAILURES,
    EngineErrors,
    EngineNamespaces,
)

logger = logging.getLogger("tenantkv")

#: A page is one block of this many synthetic "tokens" (the digest of SGLang's page hash).
PAGE_WORDS = 16
_PERSON = b"tkv-sglang-page"
_MAX_REMEMBERED_REFUSALS = 1024


def page_words(key: str) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """The 16 words tenantkv keys a page by, digested from SGLang's page hash. Not a key:
    tenantkv hashes them again under the namespace's secret key."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=64, person=_PERSON).digest()
    return np.frombuffer(digest, dtype="<u4").astype(np.uint32)


@dataclass(frozen=True)
class PageVectors:
    """The vectors an SGLang page is made of, for int4 (see the module docstring): MLA's
    ``kv_lora_rank`` + ``qk_rope_head_dim`` values, or MHA's ``head_dim``."""

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    head_dim: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def width(self) -> int:
        """Values of one vector."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.head_dim


@dataclass(frozen=True)
class PageRows:
    """How a page of ``size`` values becomes the ``PAGE_WORDS`` rows of the one block that
    tenantkv stores it as, and back: the layout of an opaque page (``vectors`` None: rows of
    ``size / 16`` values as they lie) or, for int4, rows of whole vectors."""

    size: int
    dtype: torch.dtype
    codec: str
    vectors: PageVectors | None = None

    @classmethod
    def of(cls, size: int, dtype: torch.dtype, codec: str, vectors: PageVectors | None) -> PageRows:
        """The rows of pages of ``size`` values of ``dtype``; TenantKVError for a page that does
        not split in 16 rows, InvalidRequestError for an int4 page without whole vectors."""
        if size % PAGE_WORDS or size // PAGE_WORDS < 2:
            raise TenantKVError(f"a page of {size} values does not split in 16 rows")
        if codec != "int4":
            return cls(size, dtype, codec)
        if vectors is None:
            raise InvalidRequestError(
                "codec 'int4' needs the page's vectors: register SGLang's host pool (its "
                "head_dim, or kv_lora_rank and qk_rope_head_dim) or give them in the extra config"
            )
        per_row = PAGE_WORDS if vectors.mla else 2 * PAGE_WORDS  # MHA rows are k || v
        if size % vectors.width or (size // vectors.width) % per_row:
            raise InvalidRequestError(
                f"codec 'int4' stores a page as 16 rows of whole vectors: a page of {size} "
                f"values is not a multiple of {per_row} vectors of {vectors.width}"
            )
        return cls(size, dtype, codec, vectors)

    @property
    def per_row(self) -> int:
        """Vectors in one row (int4)."""
        assert self.vectors is not None
        return self.size // self.vectors.width // PAGE_WORDS

    def layout(self) -> KVLayout:
        """The one-layer layout of such pages, under the codec."""
        vectors = self.vectors
        if vectors is None:
            layout = KVLayout.mla(1, self.size // PAGE_WORDS - 1, 1, self.dtype)
        elif vectors.mla:
            m = self.per_row
            layout = KVLayout.mla(
                1, m * vectors.kv_lora_rank, m * vectors.qk_rope_head_dim, self.dtype
            )
        else:
            layout = KVLayout.mha(1, self.per_row // 2, vectors.head_dim, self.dtype)
        return layout.with_codec(self.codec)

    def rows(self, pages: torch.Tensor) -> Layer:
        """``[n, size]`` pages as the layer ``Namespace.store_pages`` takes (16 rows a page)."""
        n = pages.shape[0]
        vectors = self.vectors
        if vectors is None:
            return pages.reshape(n * PAGE_WORDS, -1)
        m = self.per_row
        if vectors.mla:  # each row: its vectors' c_KV parts, then their k_rot parts
            split = pages.reshape(n * PAGE_WORDS, m, vectors.width)
            rank = vectors.kv_lora_rank
            latent = split[:, :, :rank].reshape(n * PAGE_WORDS, -1)
            return torch.cat((latent, split[:, :, rank:].reshape(n * PAGE_WORDS, -1)), dim=1)
        pair = pages.reshape(n * PAGE_WORDS, 2, m // 2, vectors.head_dim)
        return pair[:, 0], pair[:, 1]  # halves of the row, whatever K or V they hold

    def page(self, layer: Layer) -> torch.Tensor:
        """A loaded page's layer (16 rows) as the page's flat values."""
        vectors = self.vectors
        if isinstance(layer, tuple):  # MHA rows: (k, v) views of one [16, 2, H, D] buffer
            return torch.stack(layer, dim=1).reshape(-1)
        if vectors is None or not vectors.mla:
            return layer.reshape(-1)
        m, rank = self.per_row, vectors.kv_lora_rank
        latent = layer[:, : m * rank].reshape(PAGE_WORDS, m, rank)
        rope = layer[:, m * rank :].reshape(PAGE_WORDS, m, vectors.qk_rope_head_dim)
        return torch.cat((latent, rope), dim=2).reshape(-1)


def _adjacent(pages: list[torch.Tensor]) -> torch.Tensor | None:
    """The pages as one ``[n, size]`` view when they lie one after the other in host memory
    (consecutive pages of a page-first MLA pool, as ``batch_set_v1`` hands them): sealed
    straight from the pool, as ``set`` seals one page, instead of copied into fresh memory
    first. None when they do not."""
    first = pages[0]
    if first.device.type != "cpu" or not all(p.is_contiguous() for p in pages):
        return None
    step = first.numel() * first.element_size()
    start = first.data_ptr()
    if any(p.data_ptr() != start + i * step for i, p in enumerate(pages)):
        return None
    try:  # bounded by the storage: as_strided refuses a view past its end
        return torch.as_strided(first, (len(pages), first.numel()), (first.numel(), 1))
    except RuntimeError:
        return None


class _Target(NamedTuple):
    """Where pages shaped like one page go: the tenant's namespace, and the pages' rows."""

    namespace: Namespace
    rows: PageRows


class TenantKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage in tenantkv, for the tenant of the deployment's signed assertion."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        # How pages are stored (tenantkv.codecs), checked before the cache opens. Under none and
        # fp8 a page is one opaque block of all its layers (fp8 scales each page as a whole);
        # int4 rotates and groups whole vectors, so it stores a page as rows of them
        # (PageRows), once the vectors are known.
        self._codec = codec(extra.get("codec", "none")).name
        self._is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self._extra = extra
        self._vectors = self._page_vectors(None)
        self._kv = shared_cache(str(extra["root"]), extra.get("open_options") or {})
        self._verifier = AssertionVerifier.from_pem(
            read_pems(extra.get("gateway_public_keys")),
            audience=extra.get("audience"),
            max_lifetime=lifetime_setting(
                "max_assertion_lifetime", extra.get("max_assertion_lifetime")
            ),
            require_incarnation=extra.get("require_incarnation", False),
        )
        self._model = str(extra.get("model") or storage_config.model_name or "sglang-model")
        self._assertion = extra.get(ASSERTION_PARAM)
        self._assertion_file = extra.get("assertion_file")
        self._engines: dict[tuple[int, torch.dtype], tuple[EngineNamespaces, PageRows]] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()
        self._errors = EngineErrors(self._kv)
        self.mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: pages' transfers go through it, and int4 reads the page's vectors
        from it (refused here, at start, when its pages are not whole rows of vectors)."""
        super().register_mem_pool_host(mem_pool_host)
        if self._codec != "int4":
            return  # the other codecs store opaque pages: the pool's sizes do not matter
        vectors = self._page_vectors(mem_pool_host)
        if vectors is None:
            raise InvalidRequestError(
                "codec 'int4' needs the page's vectors: the host pool has no "
                + ("kv_lora_rank and qk_rope_head_dim" if self._is_mla else "head_dim")
                + "; give them in the extra config"
            )
        page = mem_pool_host.get_dummy_flat_data_page()
        PageRows.of(page.numel(), page.dtype, self._codec, vectors)  # refused now, or fits
        with self._lock:
            self._vectors = vectors

    def _page_vectors(self, pool: Any) -> PageVectors | None:
        """The page's vectors from the extra config, else from the host pool ``pool``: MLA's
        latent and RoPE sizes when SGLang says the model is MLA, else MHA's head size."""

        def size(name: str) -> int:
            value = self._extra.get(name, getattr(pool, name, None))
            if value is None:
                return 0
            try:  # an int, or an integer type's value (a pool's may be numpy's)
                number = operator.index(value) if not isinstance(value, bool) else 0
            except TypeError:
                number = 0
            if number <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
            return number

        if self._is_mla:
            rank, rope = size("kv_lora_rank"), size("qk_rope_head_dim")
            return PageVectors(kv_lora_rank=rank, qk_rope_head_dim=rope) if rank and rope else None
        head = size("head_dim")
        return PageVectors(head_dim=head) if head else None

    # ---- identity -----------------------------------------------------------------------------

    def _deployment_assertion(self) -> str | None:
        if self._assertion_file:
            try:
                return Path(self._assertion_file).read_text().strip() or None
            except OSError as err:
                logger.warning("tenantkv: cannot read the assertion file: %s", err)
                return None
        return self._assertion if isinstance(self._assertion, str) else None

    def _namespace(self, page: torch.Tensor, extra_info: Any = None) -> _Target | None:
        """The namespace of the verified tenant for pages shaped like ``page``, or None."""
        call_params = getattr(extra_info, "extra_info", None)
        if isinstance(call_params, dict) and ASSERTION_PARAM in call_params:
            assertion = call_params[ASSERTION_PARAM]
        else:
            assertion = self._deployment_assertion()
        engine, rows = self._engine(page)
        try:
            owner = engine.owner_of(self._verifier.verify(assertion))
        except TenantAssertionError:  # refused (an index failure: the caller counts a miss)
            key = assertion if isinstance(assertion, str) else ""
            with self._lock:
                first = key not in self._refused
                if len(self._refused) >= _MAX_REMEMBERED_REFUSALS:
                    self._refused.clear()  # bounded; at worst an event is recorded again
                self._refused.add(key)
            if first:  # one security event per refused assertion, not one per page
                engine.identify({ASSERTION_PARAM: assertion}, request_id="sglang-hicache")
            return None
        namespace = None if owner is None else engine.namespace(owner)
        return None if namespace is None else _Target(namespace, rows)

    def _engine(self, page: torch.Tensor) -> tuple[EngineNamespaces, PageRows]:
        """The namespaces for pages of this size and dtype, and how such a page is stored."""
        size, dtype = page.numel(), page.dtype
        with self._lock:
            found = self._engines.get((size, dtype))
            if found is None:
                rows = PageRows.of(size, dtype, self._codec, self._vectors)
                engine = EngineNamespaces(
                    self._kv,
                    self._verifier,
                    model=self._model,
                    layout=rows.layout(),
                    block_tokens=PAGE_WORDS,
                )
                found = self._engines[(size, dtype)] = (engine, rows)
            return found

    # ---- pages ----------------------------------------------------------------------------

    def _template(self) -> torch.Tensor:
        if self.mem_pool_host is None:
            raise TenantKVError("no host pool registered: pass target locations or values")
        return self.mem_pool_host.get_dummy_flat_data_page()  # type: ignore[no-any-return]

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
        extra_info: Any = None,
    ) -> torch.Tensor | None:
        """The page of ``key`` (written into ``target_location`` when given), or None."""
        try:
            page = target_location if target_location is not None else self._template()
            target = self._namespace(page, extra_info)
            if target is None:
                return None
            words = page_words(key)
            if target.namespace.cached_length(words) < PAGE_WORDS:
                return None
            with target.namespace.load(words) as stream:
                values = target.rows.page(stream.wait_for_layer(0))
                out = page if target_location is not None else torch.empty_like(page)
                out.view(-1).copy_(values)
            return out
        except ENGINE_FAILURES as err:  # recomputed by SGLang
            self._errors.failed("get", err, request_id=f"page {key[:16]}")
            return None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """The pages of ``keys`` (written into ``target_locations`` when given), None where
        missed, read as one batch (``Namespace.load_pages``)."""
        locations = list(target_locations or [None] * len(keys))
        if len(locations) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(locations)} target locations")
        if not keys:
            return []
        given = [loc for loc in locations if loc is not None]
        template = given[0] if given and isinstance(given[0], torch.Tensor) else None
        if given and (
            template is None
            or not all(
                isinstance(loc, torch.Tensor)
                and loc.numel() == template.numel()
                and loc.dtype == template.dtype
                for loc in given
            )
        ):  # pages of several shapes: each from its own namespace
            return [self.get(key, loc) for key, loc in zip(keys, locations, strict=True)]
        found = self._get_pages(list(keys), template)
        pages: list[torch.Tensor | None] = []
        for values, location in zip(found, locations, strict=True):
            if values is None:
                pages.append(None)
            elif location is not None:
                location.view(-1).copy_(values)
                pages.append(location)
            else:
                pages.append(values.clone())  # its own memory, not a view of the batch's
        return pages

    def _get_pages(
        self, keys: list[str], template: torch.Tensor | None, extra_info: Any = None
    ) -> list[torch.Tensor | None]:
        """Per key, its page's flat values (views of the batch's loaded layer, or a copy), or
        None: every page loaded in one ``Namespace.load_pages``."""
        try:
            page = template if template is not None else self._template()
            target = self._namespace(page, extra_info)
            if target is None:
                return [None] * len(keys)
            found = target.namespace.load_pages([page_words(key) for key in keys])
            return [None if layers is None else target.rows.page(layers[0]) for layers in found]
        except ENGINE_FAILURES as err:  # recomputed by SGLang
            self._errors.failed("get", err, request_id=f"{len(keys)} pages from {keys[0][:16]}")
            return [None] * len(keys)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
        extra_info: Any = None,
    ) -> bool:
        """Store one page; True when it is cached afterwards (stored now or before)."""
        page = value if value is not None else target_location
        if not isinstance(page, torch.Tensor):
            return False
        try:
            target = self._namespace(page, extra_info)
            if target is None:
                return False
            words = page_words(key)
            values = page.detach().to("cpu").contiguous().view(1, -1)
            target.namespace.store(words, [target.rows.rows(values)])
            return target.namespace.cached_length(words) == PAGE_WORDS
        except ENGINE_FAILURES as err:
            self._errors.failed("set", err, request_id=f"page {key[:16]}")
            return False

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        pages = values if values is not None else target_locations
        if pages is None:
            return False
        return all(self._set_pages(list(keys), list(pages)))

    def _set_pages(self, keys: list[str], pages: list[Any], extra_info: Any = None) -> list[bool]:
        """Store a batch of pages as one extent; per page, whether it is cached afterwards."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if not pages:
            return []
        first = pages[0]
        if not all(
            isinstance(p, torch.Tensor) and p.numel() == first.numel() and p.dtype == first.dtype
            for p in pages
        ):  # pages of several shapes: each to its own namespace
            return [self.set(k, p, extra_info=extra_info) for k, p in zip(keys, pages, strict=True)]
        try:
            target = self._namespace(first, extra_info)
            if target is None:
                return [False] * len(keys)
            words = [page_words(key) for key in keys]
            values = _adjacent(pages)
            if values is None:
                values = torch.stack([p.detach().reshape(-1) for p in pages]).to("cpu")
            target.namespace.store_pages(words, [target.rows.rows(values)])
            return target.namespace.cached_pages(words)
        except ENGINE_FAILURES as err:
            self._errors.failed("set", err, request_id=f"{len(keys)} pages from {keys[0][:16]}")
            return [False] * len(keys)

    def exists(self, key: str, extra_info: Any = None) -> bool:
        try:
            target = self._namespace(self._template(), extra_info)
            if target is None:
                return False
            return target.namespace.cached_length(page_words(key)) == PAGE_WORDS
        except ENGINE_FAILURES as err:
            self._errors.failed("exists", err, request_id=f"page {key[:16]}")
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are cached (SGLang's longest-prefix rule): one
        assertion check and one index read for the batch (``Namespace.cached_pages``)."""
        if not keys:
            return 0
        try:
            target = self._namespace(self._template(), extra_info)
            if target is None:
                return 0
            cached = target.namespace.cached_pages([page_words(key) for key in keys])
        except ENGINE_FAILURES as err:
            self._errors.failed("exists", err, request_id=f"{len(keys)} pages from {keys[0][:16]}")
            return 0
        return next((index for index, hit in enumerate(cached) if not hit), len(keys))

    # ---- host-pool transfers ------------------------------------------------------------------

    def _host_index(self, host_indices: torch.Tensor, page: int) -> int:
        return int(host_indices[page * self.mem_pool_host.page_size])

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load pages into the host pool at ``host_indices`` (one index per page's tokens), read
        as one batch (``Namespace.load_pages``); a page missed leaves its slots as they were."""
        if not keys:
            return []
        found = self._get_pages(list(keys), None, extra_info)
        for page, values in enumerate(found):
            if values is not None:
                index = self._host_index(host_indices, page)
                self.mem_pool_host.set_from_flat_data_page(index, values)
        return [values is not None for values in found]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``, as one extent."""
        pages = [
            self.mem_pool_host.get_data_page(self._host_index(host_indices, page), flat=True)
            for page in range(len(keys))
        ]
        return self._set_pages(list(keys), pages, extra_info)
