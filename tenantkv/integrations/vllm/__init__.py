"""tenantkv inside vLLM: a KV connector (``KVConnectorBase_V1``) for per-tenant encrypted
prefix caches, with the tenant taken from a gateway's signed assertion (extra ``vllm``).

Configure vLLM with::

    KVTransferConfig(
        kv_connector="TenantKVConnector",
        kv_connector_module_path="tenantkv.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"root": "/var/lib/tenantkv",
                                   "gateway_public_keys": ["/etc/tenantkv/gateway.pub.pem"]},
    )

and pass ``{"tenantkv_assertion": <signed assertion>}`` as each request's ``kv_transfer_params``.
docs/engines.md describes the settings and the flow; the modules split the work as vLLM does:
``scheduler_side`` (matched tokens, per-step metadata), ``worker_side`` (loads into and saves
from the paged KV), ``settings`` (extra config, layout, the shared cache), ``connector`` (the
class vLLM builds once per role).
"""

try:
    import vllm  # noqa: F401  (only to say which extra is missing)
except ImportError as err:  # a sentence rather than a traceback ending deep in our imports
    raise ImportError(
        "tenantkv.integrations.vllm needs vLLM: pip install 'tenantkv[vllm]' "
        "(docs/engines.md; the CPU build: scripts/setup_engines.sh)"
    ) from err

from .connector import TenantKVConnector

__all__ = ["TenantKVConnector"]
