"""tenantkv: a secure, multi-tenant KV-cache layer for LLM inference.

::

    kv = tenantkv.open(root)
    kv.create_tenant("acme")
    layout = tenantkv.KVLayout.mla(61, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    ns = kv.namespace("acme", model="deepseek-v3", layout=layout)
    ns.store(tokens, layers)
    n = ns.lookup(tokens)
    with ns.load(tokens[:n]) as stream:
        for layer_index, layer in stream: ...
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import TenantKV, open
    from .components.metering import UsageReport
    from .config import CacheConfig
    from .datapath.loader import LoadStream
    from .errors import (
        CacheClosedError,
        CacheMissError,
        CacheNotFoundError,
        CacheUnavailableError,
        InvalidRequestError,
        JobNotFoundError,
        JobStateError,
        LoadError,
        LoadRevokedError,
        MasterKeyError,
        QuotaExceededError,
        SchemaVersionError,
        SegmentIntegrityError,
        TenantExistsError,
        TenantKVError,
        TenantNotFoundError,
    )
    from .layout import KVLayout, Layer
    from .prefix import BLOCK_TOKENS
    from .services.gc import GcReport
    from .services.namespace import Namespace
    from .services.tenants import TenantInfo

__version__ = "0.1.0"

#: Where each public name lives. Imported on first use (PEP 562), so that ``import tenantkv``
#: and the CLI's parser (``tenantkv --help``, a mistyped argument) do not pay for torch and the
#: data path (seconds on a small host); ``tenantkv.open`` and the rest import them when used.
_EXPORTS: dict[str, str] = {
    "TenantKV": ".api",
    "open": ".api",
    "UsageReport": ".components.metering",
    "CacheConfig": ".config",
    "LoadStream": ".datapath.loader",
    "CacheClosedError": ".errors",
    "CacheMissError": ".errors",
    "CacheNotFoundError": ".errors",
    "CacheUnavailableError": ".errors",
    "InvalidRequestError": ".errors",
    "JobNotFoundError": ".errors",
    "JobStateError": ".errors",
    "LoadError": ".errors",
    "LoadRevokedError": ".errors",
    "MasterKeyError": ".errors",
    "QuotaExceededError": ".errors",
    "SchemaVersionError": ".errors",
    "SegmentIntegrityError": ".errors",
    "TenantExistsError": ".errors",
    "TenantKVError": ".errors",
    "TenantNotFoundError": ".errors",
    "KVLayout": ".layout",
    "Layer": ".layout",
    "BLOCK_TOKENS": ".prefix",
    "GcReport": ".services.gc",
    "Namespace": ".services.namespace",
    "TenantInfo": ".services.tenants",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet (``tenantkv.errors``)
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'tenantkv' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "BLOCK_TOKENS",
    "CacheClosedError",
    "CacheConfig",
    "CacheMissError",
    "CacheNotFoundError",
    "CacheUnavailableError",
    "GcReport",
    "InvalidRequestError",
    "JobNotFoundError",
    "JobStateError",
    "KVLayout",
    "Layer",
    "LoadError",
    "LoadRevokedError",
    "LoadStream",
    "MasterKeyError",
    "Namespace",
    "QuotaExceededError",
    "SchemaVersionError",
    "SegmentIntegrityError",
    "TenantExistsError",
    "TenantInfo",
    "TenantKV",
    "TenantKVError",
    "TenantNotFoundError",
    "UsageReport",
    "__version__",
    "open",
]
