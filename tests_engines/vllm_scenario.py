"""Run one vLLM ``LLM`` on CPU with a KV connector and a list of requests; print what happened.

    python -m tests_engines.vllm_scenario SPEC.json

SPEC: ``{"model", "connector": "tenantkv" | "example", "extra": {...}, "requests": [{"name",
"prompt": [...], "params": {...} | null, "salt": str | null}], "max_tokens"}``. Requests run
one after another (each its own ``generate``), with vLLM's own prefix cache off, so a cached
token can only come from the connector. Prints one JSON line: per request its generated tokens,
``num_cached_tokens`` and time to first token; for tenantkv also the security events and the
usage counters of the cache the connector opened.

A separate process per engine: vLLM keeps its KV connector in a process-wide global, so two
``LLM`` s with different connectors cannot share one process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if spec["connector"] == "tenantkv":
        transfer = KVTransferConfig(
            kv_connector="TenantKVConnector",
            kv_connector_module_path="tenantkv.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["extra"],
        )
    else:
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=spec["extra"],
        )
    backend = spec.get("attention_backend")
    return LLM(
        model=spec["model"],
        attention_config={"backend": backend} if backend else None,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        kv_transfer_config=transfer,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        disable_hybrid_kv_cache_manager=True,
        seed=0,
    )


def run_request(llm: Any, request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": request["params"]} if request.get("params") else None
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0, detokenize=False, extra_args=extra
    )
    prompt = TokensPrompt(prompt_token_ids=request["prompt"])
    if request.get("salt"):
        prompt["cache_salt"] = request["salt"]
    started = time.perf_counter()
    (output,) = llm.generate([prompt], sampling, use_tqdm=False)
    wall = time.perf_counter() - started
    metrics = output.metrics
    ttft = None
    if metrics is not None and getattr(metrics, "first_token_latency", None):
        ttft = float(metrics.first_token_latency)
    return {
        "name": request["name"],
        "tokens": list(output.outputs[0].token_ids),
        "num_cached_tokens": int(output.num_cached_tokens or 0),
        "ttft": ttft,
        "wall": wall,
    }


def main() -> None:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    llm = build_llm(spec)
    results = []
    for _ in range(int(spec.get("warmup", 0))):
        run_request(llm, spec["requests"][0] | {"params": None}, 1)
    for request in spec["requests"]:
        results.append(run_request(llm, request, int(spec.get("max_tokens", 4))))
    report: dict[str, Any] = {"results": results}
    if spec["connector"] == "tenantkv":
        from tenantkv.integrations.engine_cache import open_caches

        (kv,) = open_caches()
        report["security_events"] = kv.security_events()
        report["usage"] = {t.name: dict(kv.usage(t.name).counters) for t in kv.list_tenants()}
    print("SCENARIO " + json.dumps(report), flush=True)
    os._exit(0)  # skip vLLM's slow teardown; the report is out


if __name__ == "__main__":
    main()
