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

__all__ = [
    "BLOCK_TOKENS",
    "CacheClosedError",
    "CacheConfig",
    "CacheMissError",
    "CacheNotFoundError",
    "CacheUnavailableError",
    "GcReport",
    "InvalidRequestError",
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
