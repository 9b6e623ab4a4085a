"""tenantkv as an SGLang HiCache storage backend (extra ``sglang``): per-tenant encrypted pages.

Start SGLang with ``--hicache-storage-backend dynamic`` and the extra config::

    {"backend_name": "tenantkv", "module_path": "tenantkv.integrations.sglang",
     "class_name": "TenantKVHiCacheStorage",
     "root": "/var/lib/tenantkv", "gateway_public_keys": ["/etc/tenantkv/gateway.pub.pem"],
     "assertion_file": "/run/tenantkv/assertion"}

``"codec"`` in the extra config (``"none"``, the default, or ``"fp8"``; see ``tenantkv.codecs``)
stores pages coded: a page is one opaque block, so fp8 scales each page as a whole (e4m3's
exponent keeps each value's relative precision, down to 2^-9 of the page's largest value).
``"int4"`` is refused: it rotates and groups head vectors, which an opaque page does not show.

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
sealing pass, one file, one index transaction), each page still keyed and found on its own.
``batch_get_v1`` and ``batch_set_v1`` move pages between the store and host-pool indices with
one copy each way.

**Failures.** A page that fails to open (tampering, corruption; a security event, the extent
dropped) or whose bytes are gone is a miss (``False``/``None``): SGLang recomputes it. Any other
error of the cache (a page of a size it cannot key, an index outage, a closed cache) is a miss
too, counted as an ``engine_errors`` health event and logged at most once a minute per call.
Never an exception into SGLang, never wrong data.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

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
from ..layout import KVLayout
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


class TenantKVHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage in tenantkv, for the tenant of the deployment's signed assertion."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
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
        # How pages are stored (tenantkv.codecs). A page is one opaque block of all its layers,
        # so fp8 scales each page as a whole; int4 rotates and groups per head vector, which an
        # opaque page does not show (its rows would split at odd sizes): not offered here.
        self._codec = codec(extra.get("codec", "none")).name
        if self._codec == "int4":
            raise InvalidRequestError(
                "codec 'int4' is not offered for SGLang pages (an opaque page has no head "
                "vectors to rotate and group); use 'fp8' or 'none'"
            )
        self._assertion = extra.get(ASSERTION_PARAM)
        self._assertion_file = extra.get("assertion_file")
        self._engines: dict[tuple[int, torch.dtype], EngineNamespaces] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()
        self._errors = EngineErrors(self._kv)
        self.mem_pool_host: Any = None

    # ---- identity -----------------------------------------------------------------------------

    def _deployment_assertion(self) -> str | None:
        if self._assertion_file:
            try:
                return Path(self._assertion_file).read_text().strip() or None
            except OSError as err:
                logger.warning("tenantkv: cannot read the assertion file: %s", err)
                return None
        return self._assertion if isinstance(self._assertion, str) else None

    def _namespace(self, page: torch.Tensor, extra_info: Any = None) -> Namespace | None:
        """The namespace of the verified tenant for pages shaped like ``page``, or None."""
        call_params = getattr(extra_info, "extra_info", None)
        if isinstance(call_params, dict) and ASSERTION_PARAM in call_params:
            assertion = call_params[ASSERTION_PARAM]
        else:
            assertion = self._deployment_assertion()
        engine = self._engine(page)
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
        return None if owner is None else engine.namespace(owner)

    def _engine(self, page: torch.Tensor) -> EngineNamespaces:
        """The namespaces for pages of this size and dtype (the layout of an opaque page)."""
        size, dtype = page.numel(), page.dtype
        with self._lock:
            engine = self._engines.get((size, dtype))
            if engine is None:
                if size % PAGE_WORDS or size // PAGE_WORDS < 2:
                    raise TenantKVError(f"a page of {size} values does not split in 16 rows")
                layout = KVLayout.mla(1, size // PAGE_WORDS - 1, 1, dtype).with_codec(self._codec)
                engine = EngineNamespaces(
                    self._kv,
                    self._verifier,
                    model=self._model,
                    layout=layout,
                    block_tokens=PAGE_WORDS,
                )
                self._engines[(size, dtype)] = engine
            return engine

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
            namespace = self._namespace(page, extra_info)
            if namespace is None:
                return None
            words = page_words(key)
            if namespace.cached_length(words) < PAGE_WORDS:
                return None
            with namespace.load(words) as stream:
                rows = stream.wait_for_layer(0)
                assert isinstance(rows, torch.Tensor)
                out = page if target_location is not None else torch.empty_like(page)
                out.view(-1).copy_(rows.reshape(-1))
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
        locations = target_locations or [None] * len(keys)
        return [self.get(key, location) for key, location in zip(keys, locations, strict=True)]

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
            namespace = self._namespace(page, extra_info)
            if namespace is None:
                return False
            words = page_words(key)
            rows = page.detach().to("cpu").contiguous().view(-1).reshape(PAGE_WORDS, -1)
            namespace.store(words, [rows])
            return namespace.cached_length(words) == PAGE_WORDS
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
            namespace = self._namespace(first, extra_info)
            if namespace is None:
                return [False] * len(keys)
            words = [page_words(key) for key in keys]
            rows = torch.stack([p.detach().reshape(-1) for p in pages]).to("cpu")
            namespace.store_pages(words, [rows.reshape(len(pages) * PAGE_WORDS, -1)])
            return [namespace.cached_length(w) == PAGE_WORDS for w in words]
        except ENGINE_FAILURES as err:
            self._errors.failed("set", err, request_id=f"{len(keys)} pages from {keys[0][:16]}")
            return [False] * len(keys)

    def exists(self, key: str, extra_info: Any = None) -> bool:
        try:
            namespace = self._namespace(self._template(), extra_info)
            return namespace is not None and namespace.cached_length(page_words(key)) == PAGE_WORDS
        except ENGINE_FAILURES as err:
            self._errors.failed("exists", err, request_id=f"page {key[:16]}")
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are cached (SGLang's longest-prefix rule)."""
        for index, key in enumerate(keys):
            if not self.exists(key, extra_info):
                return index
        return len(keys)

    # ---- host-pool transfers ------------------------------------------------------------------

    def _host_index(self, host_indices: torch.Tensor, page: int) -> int:
        return int(host_indices[page * self.mem_pool_host.page_size])

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices`` (one per page)."""
        done: list[bool] = []
        for page, key in enumerate(keys):
            data = self.get(key, extra_info=extra_info)
            if data is None:
                done.append(False)
                continue
            self.mem_pool_host.set_from_flat_data_page(self._host_index(host_indices, page), data)
            done.append(True)
        return done

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``, as one extent."""
        pages = [
            self.mem_pool_host.get_data_page(self._host_index(host_indices, page), flat=True)
            for page in range(len(keys))
        ]
        return self._set_pages(list(keys), pages, extra_info)
