"""The connector's settings (vLLM's ``kv_connector_extra_config``), its KV layout (from the
engine's KV cache config) and the cache it opens.

Extra config keys:

* ``root`` (required): the cache root, as for ``tenantkv.open``; ``open_options`` (a dict) are
  further ``tenantkv.open`` settings (``database_url``, ``block_store_url``, ...).
* ``gateway_public_keys`` (required): PEM text or paths of PEM files of the gateways' Ed25519
  public keys; ``audience``: the deployment name assertions must carry;
  ``max_assertion_lifetime``: seconds (default 300).
* ``model``: the model's name in namespaces (default: vLLM's ``model``), ``revision`` likewise.
* ``load_async``: load between scheduler steps (``True``) instead of layer by layer during the
  forward pass (``False``, the default).

The scheduler and the worker side each build a connector; in one process they share one open
cache per root (``shared_cache``), closed when the process exits.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...api import TenantKV
from ...api import open as open_cache
from ...errors import InvalidRequestError
from ...layout import KVLayout
from ...tenant_assertion import DEFAULT_MAX_LIFETIME, AssertionVerifier

_caches: dict[str, TenantKV] = {}
_caches_lock = threading.Lock()


@dataclass(frozen=True)
class ConnectorSettings:
    root: str
    open_options: Mapping[str, Any]
    gateway_public_keys: tuple[bytes, ...]
    audience: str | None
    max_assertion_lifetime: float
    model: str
    revision: str | None
    load_async: bool

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], default_model: str) -> ConnectorSettings:
        root = extra.get("root")
        if not isinstance(root, str) or not root:
            raise InvalidRequestError("kv_connector_extra_config needs 'root' (the cache root)")
        keys = extra.get("gateway_public_keys")
        if isinstance(keys, str) or not keys:
            raise InvalidRequestError(
                "kv_connector_extra_config needs 'gateway_public_keys' (a list of PEM texts or "
                "paths): without them no request could prove its tenant"
            )
        return cls(
            root=root,
            open_options=dict(extra.get("open_options") or {}),
            gateway_public_keys=tuple(_read_pem(key) for key in keys),
            audience=extra.get("audience"),
            max_assertion_lifetime=float(extra.get("max_assertion_lifetime", DEFAULT_MAX_LIFETIME)),
            model=str(extra.get("model") or default_model),
            revision=extra.get("revision"),
            load_async=bool(extra.get("load_async", False)),
        )

    def verifier(self) -> AssertionVerifier:
        return AssertionVerifier.from_pem(
            self.gateway_public_keys,
            audience=self.audience,
            max_lifetime=self.max_assertion_lifetime,
        )


def _read_pem(key: Any) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str) and "-----BEGIN" in key:
        return key.encode("ascii")
    if isinstance(key, str):
        return Path(key).read_bytes()
    raise InvalidRequestError("gateway_public_keys holds PEM texts or paths")


def shared_cache(settings: ConnectorSettings) -> TenantKV:
    """One open cache per root in this process (the scheduler and worker sides share it)."""
    with _caches_lock:
        kv = _caches.get(settings.root)
        if kv is None or kv.context.runtime.closed:
            kv = open_cache(settings.root, **settings.open_options)
            _caches[settings.root] = kv
        return kv


@atexit.register
def _close_caches() -> None:
    with _caches_lock:
        for kv in _caches.values():
            kv.close()
        _caches.clear()


def layout_of(kv_cache_config: Any, hf_config: Any) -> tuple[KVLayout, list[str], int]:
    """(layout, attention layer names in model order, block size) of the engine's KV cache.

    One KV cache group only (start vLLM with ``disable_hybrid_kv_cache_manager=True`` for
    models that mix attention kinds); MLA when the spec is vLLM's ``MLAAttentionSpec``.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise InvalidRequestError(
            f"tenantkv needs one KV cache group, the engine has {len(groups)} "
            "(set disable_hybrid_kv_cache_manager=True)"
        )
    spec = groups[0].kv_cache_spec
    names = list(groups[0].layer_names)
    dtype = spec.dtype
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequestError(f"unsupported KV cache dtype {dtype!r}")
    if type(spec).__name__ == "MLAAttentionSpec":
        rank = int(getattr(hf_config, "kv_lora_rank", 0) or 0)
        rope = int(getattr(hf_config, "qk_rope_head_dim", 0) or 0)
        if rank + rope != spec.head_size:
            raise InvalidRequestError(
                f"MLA head size {spec.head_size} is not kv_lora_rank {rank} + rope {rope}"
            )
        return KVLayout.mla(len(names), rank, rope, dtype), names, int(spec.block_size)
    head_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    if type(spec).__name__ != "FullAttentionSpec" or head_v != spec.head_size:
        raise InvalidRequestError(f"unsupported KV cache spec {type(spec).__name__}")
    layout = KVLayout.mha(len(names), int(spec.num_kv_heads), int(spec.head_size), dtype)
    return layout, names, int(spec.block_size)
