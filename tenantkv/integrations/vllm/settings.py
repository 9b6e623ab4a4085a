"""The connector's settings (vLLM's ``kv_connector_extra_config``), its KV layout (from the
engine's KV cache config) and the cache it opens.

Extra config keys:

* ``root`` (required): the cache root, as for ``tenantkv.open``; ``open_options`` (a dict) are
  further ``tenantkv.open`` settings (``database_url``, ``block_store_url``, ...). Unless they
  say otherwise, the connector's cache keeps at least ``ENGINE_WINDOW`` layers of a load ready
  ahead of the model (``window``; the library's default is one per core, at least 2).
* ``gateway_public_keys`` (required): PEM text or paths of PEM files of the gateways' Ed25519
  public keys; ``audience``: the deployment name assertions must carry;
  ``max_assertion_lifetime``: seconds (default 300, at most 3600; a finite number);
  ``require_incarnation``: refuse assertions that do not name the tenant's incarnation
  (default false; see ``tenantkv.tenant_assertion``).
* ``model``: the model's name in namespaces (default: vLLM's ``model``), ``revision`` likewise.
* ``load_async``: load between scheduler steps (``True``) instead of in the forward step
  (``False``, the default).
* ``layer_wise``: how a load in the forward step runs. ``True`` (the default): layer by layer
  during the forward pass, so layer ``i`` computes while layers ``i + 1 ...`` are read (on a
  GPU the model and the decrypting CPUs work side by side). ``False``: the whole load in
  ``start_load_kv``, before the forward. ``"auto"``: ``False`` where the forward computes on
  every CPU the load could use (pages in host memory and torch's threads as many as the
  process's CPUs: vLLM's CPU backend), else ``True`` (``worker_side.forward_takes_every_cpu``).
  On a 2-core VM's CPU backend a load before the forward made later turns' hits 0.86-1.12x
  (median 0.96x) of layer-wise ones (docs/perf.md); the default stays layer by layer until a
  many-core figure shows the same.
* ``codec``: how the namespaces store KV (``tenantkv.codecs``): ``"none"`` (the default,
  byte-exact), ``"fp8"`` or ``"int4"`` (lossy; docs/perf.md has their measured error). Part of
  the namespaces' identity: engines with another codec never share their blocks.

Or one key, ``config_file``: the path of the deployment's configuration file
(``tenantkv.settings_file``), whose ``[cache]`` table is the cache (``TENANTKV_*`` variables
override it, as everywhere) and whose ``[vllm]`` table holds the keys above but ``root`` and
``open_options`` (the table has no environment variables: the connector never read any). The
other keys are then refused, so that one engine's settings live in one place.

The scheduler and the worker side each build a connector; in one process they share one open
cache per root (``tenantkv.integrations.engine_cache``), closed when the process exits.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...api import TenantKV
from ...codecs import codec
from ...config import CacheConfig
from ...errors import InvalidRequestError
from ...layout import KVLayout
from ...settings_file import Section, SettingsFile
from ...tenant_assertion import AssertionVerifier, lifetime_setting
from ..engine_cache import read_pems
from ..engine_cache import shared_cache as _shared_cache

#: Layers a load keeps ready ahead of the model in the connector's cache (``window``). The model
#: asks for layer after layer faster than loader threads held back by a short window can be
#: woken for each: vLLM on CPU (8-layer model, 256-2,048-token hits) waited 0.4-0.9 ms for
#: every layer past the second with the default of 2 and 0.01-0.02 ms with 16, and with 8 its
#: hits took 7-23% less time (2% where the first read after a store goes to the disk;
#: docs/perf.md, "vLLM on CPU"). Memory: up to this many layers of each running load at once
#: (8 x 9.4 MB for an 8K-token DeepSeek-V3 prefix).
ENGINE_WINDOW = 8


@dataclass(frozen=True)
class ConnectorSettings:
    root: str
    open_options: Mapping[str, Any]
    gateway_public_keys: tuple[bytes, ...]
    audience: str | None
    max_assertion_lifetime: float
    require_incarnation: bool
    model: str
    revision: str | None
    load_async: bool
    codec: str = "none"
    #: True: layer by layer; False: whole before the forward; None ("auto"): from the pages
    layer_wise: bool | None = True

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], default_model: str) -> ConnectorSettings:
        if "config_file" in extra:
            return cls.from_config_file(extra, default_model)
        root = extra.get("root")
        if not isinstance(root, str) or not root:
            raise InvalidRequestError("kv_connector_extra_config needs 'root' (the cache root)")
        return cls(
            root=root,
            open_options=_with_engine_window(dict(extra.get("open_options") or {})),
            gateway_public_keys=read_pems(extra.get("gateway_public_keys")),
            audience=extra.get("audience"),
            max_assertion_lifetime=lifetime_setting(
                "max_assertion_lifetime", extra.get("max_assertion_lifetime")
            ),
            require_incarnation=_flag("require_incarnation", extra.get("require_incarnation")),
            model=str(extra.get("model") or default_model),
            revision=extra.get("revision"),
            load_async=bool(extra.get("load_async", False)),
            codec=codec(extra.get("codec", "none")).name,
            layer_wise=layer_wise_setting(extra.get("layer_wise", True)),
        )

    @classmethod
    def from_config_file(cls, extra: Mapping[str, Any], default_model: str) -> ConnectorSettings:
        """Settings from the file ``extra["config_file"]`` names: ``[cache]`` (with the
        environment over it) and ``[vllm]``."""
        path = extra["config_file"]
        others = sorted(set(extra) - {"config_file"})
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("config_file must be the path of a configuration file")
        if others:
            raise InvalidRequestError(
                f"kv_connector_extra_config names a config_file: put {', '.join(others)} in "
                "its [vllm] or [cache] table, not beside it"
            )
        settings_file = SettingsFile.read(path)
        settings_file.check_sections()
        section: ConnectorSection = settings_file.build(CONNECTOR_SECTION, os.environ)
        cache = CacheConfig.from_env(config_file=path)
        defaults = CacheConfig()
        options = {
            f.name: getattr(cache, f.name)
            for f in dataclasses.fields(cache)
            if f.init
            and f.name not in ("root", "master_key")
            and getattr(cache, f.name) != getattr(defaults, f.name)
        }
        return cls(
            root=str(cache.root),
            open_options=_with_engine_window(options),
            gateway_public_keys=section.pems,
            audience=section.audience,
            max_assertion_lifetime=lifetime_setting(
                "max_assertion_lifetime", section.max_assertion_lifetime
            ),
            require_incarnation=section.require_incarnation,
            model=section.model or default_model,
            revision=section.revision,
            load_async=section.load_async,
            codec=section.codec,
            layer_wise=layer_wise_setting(section.layer_wise),
        )

    def verifier(self) -> AssertionVerifier:
        return AssertionVerifier.from_pem(
            self.gateway_public_keys,
            audience=self.audience,
            max_lifetime=self.max_assertion_lifetime,
            require_incarnation=self.require_incarnation,
        )


@dataclass(frozen=True, kw_only=True)
class ConnectorSection:
    """The configuration file's ``[vllm]`` table (see the module's docstring); checked as it is
    built, so ``tenantkv config check`` reports a missing key file or a bad lifetime."""

    gateway_public_keys: list[str] = field(default_factory=list)
    audience: str | None = None
    max_assertion_lifetime: float | None = None
    require_incarnation: bool = False
    model: str | None = None
    revision: str | None = None
    load_async: bool = False
    codec: str = "none"
    layer_wise: bool | str = True
    pems: tuple[bytes, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pems", read_pems(self.gateway_public_keys))
        except OSError as err:
            raise InvalidRequestError(
                f"gateway_public_keys: cannot read {err.filename}: {err.strerror}"
            ) from None
        lifetime_setting("max_assertion_lifetime", self.max_assertion_lifetime)
        codec(self.codec)  # an unknown codec is refused when the file is checked
        layer_wise_setting(self.layer_wise)


#: The configuration file's ``[vllm]`` table.
CONNECTOR_SECTION = Section("vllm", ConnectorSection, from_env=False)


def _flag(name: str, raw: Any) -> bool:
    if raw is None:
        return False
    if not isinstance(raw, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {raw!r}")
    return raw


def layer_wise_setting(raw: Any) -> bool | None:
    """``layer_wise`` as the worker side takes it: True, False, or None for ``"auto"``."""
    if raw == "auto":
        return None
    if not isinstance(raw, bool):
        raise InvalidRequestError(f'layer_wise must be true, false or "auto", got {raw!r}')
    return raw


def _with_engine_window(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with a ``window`` of ``ENGINE_WINDOW`` layers, or the library's own default
    where that is longer (one per core), unless they name one."""
    if "window" not in options:
        options["window"] = max(ENGINE_WINDOW, CacheConfig().read_ahead)
    return options


def shared_cache(settings: ConnectorSettings) -> TenantKV:
    """The process's cache for this root (the scheduler and worker sides share it)."""
    return _shared_cache(settings.root, settings.open_options)


def layout_of(kv_cache_config: Any, hf_config: Any) -> tuple[KVLayout, list[str], int]:
    """(layout, attention layer names in model order, block size) of the engine's KV cache.

    One KV cache group only (start vLLM with ``disable_hybrid_kv_cache_manager=True`` for
    models that mix attention kinds); MLA when the spec is vLLM's ``MLAAttentionSpec``, else
    MHA/GQA kept as the engine's pages (``mha-pages``, pages of the engine's block size).
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
    # Stored as the pages are kept, so that a load decrypts straight into them
    # (``mha-pages``; docs/perf.md, "vLLM: MHA pages stored as they are").
    block = int(spec.block_size)
    layout = KVLayout.mha_pages(
        len(names), int(spec.num_kv_heads), int(spec.head_size), block, dtype
    )
    return layout, names, block
