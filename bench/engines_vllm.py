#!/usr/bin/env python3
"""vLLM on CPU: time to first token with and without a cached prefix, tenantkv's connector
against vLLM's in-tree ExampleConnector and against no connector at all.

Model: a random Llama written at run time (8 layers, hidden 512, 8 query heads and 4 KV heads of
64, fp32; nothing downloaded), vLLM's CPU backend, 32-token blocks, vLLM's own prefix cache off
(so a cached token can only come from the connector), one request at a time.

For each prompt length (default 256, 1,024 and 2,048 tokens) and repetition, a fresh prompt is
sent three times: the first request misses (computes the prompt, and the connector stores it),
the second hits (loads all full blocks before the last token, computes the rest), the third
(``hit-again``: a later turn, the miss's store done before it) hits again. TTFT is the wall
time of ``generate`` with ``max_tokens=1``: prefill plus the first token, the connector's lookup,
load and (on the miss) store included. Each engine runs in a process of its own (vLLM keeps its
connector in a process-wide global): ``none`` (no connector: every request computes),
``example`` (ExampleConnector: safetensors files per layer, keyed by token bytes, no
encryption, no tenants), ``tenantkv`` (this connector: signed assertion verified, keyed
prefix hashes, AES-GCM segments, SQLite index; durable stores written with ``O_DIRECT``, the
default), ``tenantkv-buffered`` (the same with ``direct_writes=False``: extents written through
the page cache, as ExampleConnector's files are, so the hit reads memory instead of the disk),
and, run only when named in ``--engines``, ``tenantkv-openmp-teams`` (the same-run baseline of
the cache's threads left at torch's default OpenMP count, each free to start an OpenMP team
beside the model's: ``tenantkv/openmp_threads.py``) and ``tenantkv-before-forward`` (the
connector's ``layer_wise=False``: each hit's whole load in ``start_load_kv``, before the
forward, instead of layer by layer inside it) and ``tenantkv-token-rows`` (the same-run
baseline of MHA layers stored as token rows, ``KVLayout.mha``, as before the connector kept
them as vLLM's pages: each layer loaded into a tensor, then copied into the pages) and
``tenantkv-window-from-consumed`` (the same-run baseline of a load's read-ahead window counted
from the layers the caller consumed alone, as before it followed the layer the caller waits
for: the connector's layer hooks never consume, so the loader stopped ``window`` layers in and
loaded each later layer once the forward was blocked on it). Every hit's first token is checked
against the miss's.

Reported: min / median / max ms per (engine, length, miss|hit); the hit/miss ratio within each
engine, tenantkv's hit against ExampleConnector's hit, and a turn's miss + hit against
ExampleConnector's (the write policy moves time between the two; ratios of medians, same run);
a PNG.

tenantkv stores in the background (the store leaves the forward step; the next request for the
same prefix waits until it is indexed), so its miss is the prefill plus the copy-free hand-off,
and a hit right after a miss may include the rest of that store.

Engines run in ``--rounds`` passes (default 2), the order reversed every other pass.

``--engine-core in-process`` (the default) runs vLLM's engine core in the benchmark's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``LLM`` in a script); ``separate`` runs it in processes
of its own, as ``vllm serve`` does. The two differ for background work: the in-process engine
loop steps again at once while a request waits (for a load or a save), holding the GIL between
steps, where the separate engine core sleeps a millisecond after a step that ran no model
(docs/perf.md, "vLLM: the hit right after its miss, and the GIL").

Run (in the engine venv, scripts/setup_engines.sh):
    .venv-engines/bin/python bench/engines_vllm.py [--lengths 256,1024,2048] [--reps 3] \
        [--rounds 2] [--engine-core in-process|separate] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINES = (
    "none",
    "example",
    "tenantkv",
    "tenantkv-buffered",
    "tenantkv-openmp-teams",
    "tenantkv-before-forward",
    "tenantkv-token-rows",
    "tenantkv-window-from-consumed",
)
DEFAULT_ENGINES = "none,example,tenantkv,tenantkv-buffered"
BLOCK_TOKENS = 32  # vLLM's block size here
# The random Llama's shape (write_model), and through it the KV a hit loads (kv_layout).
LAYERS, HIDDEN, HEADS, KV_HEADS = 8, 512, 8, 4


def fresh_prompt(length: int, rep: int, round_: int) -> list[int]:
    """A prompt of ``length`` tokens that no other (length, rep, round) of a run sends."""
    base = 1 + (length * 7 + rep * 131 + round_ * 977) % 2000
    return [(base + i * 13) % 4000 + 1 for i in range(length)]


def cached_on_hit(length: int) -> int:
    """Tokens a hit of a ``length``-token prompt takes from the connector: its full blocks
    before the last token (the last token is always computed)."""
    return (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def write_model(directory: Path) -> None:
    from _fixtures import random_llama

    model = random_llama(
        hidden_size=HIDDEN,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    model.save_pretrained(directory, safe_serialization=True)


def kv_layout() -> Any:
    """The model's KV as the connector stores it (fp32 K and V per layer, as vLLM's pages)."""
    import torch

    from tenantkv.layout import KVLayout

    return KVLayout.mha_pages(LAYERS, KV_HEADS, HIDDEN // HEADS, BLOCK_TOKENS, torch.float32)


def _store_token_rows() -> None:
    """The baseline of MHA layers kept as token rows (``KVLayout.mha``, ``k_t || v_t``), as the
    connector kept them before it stored vLLM's pages as they are (``mha-pages``): its loads
    decrypt into a layer tensor and copy it into the pages, head by head."""
    from tenantkv.integrations.vllm import connector, settings
    from tenantkv.layout import KVLayout

    def token_rows(kv_cache_config: Any, hf_config: Any) -> tuple[Any, list[str], int]:
        pages, names, block = settings.layout_of(kv_cache_config, hf_config)
        rows = KVLayout.mha(pages.num_layers, pages.num_kv_heads, pages.head_dim, pages.dtype)
        return rows, names, block

    connector.layout_of = token_rows  # type: ignore[assignment]


def build_llm(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The engine a worker's spec names: (LLM, sampling parameters of a request with the
    spec's connector parameters, those of a plain request)."""
    separate = spec.get("engine_core") == "separate"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # 1 GiB of KV cache: without it vLLM's CPU backend reserves 92% of the machine's memory
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    # The baselines (an earlier choice put back), set before the connector opens the cache.
    if spec["engine"] == "tenantkv-openmp-teams":
        from tenantkv import openmp_threads

        openmp_threads.ONE_THREAD_ON_CACHE_THREADS = False
    elif spec["engine"] == "tenantkv-books-20ms":  # bench/vllm_hit_phases.py's
        from tenantkv.datapath import runtime

        runtime.BOOKKEEPING_DELAY_S, runtime.BOOKKEEPING_HOLD_S = 0.02, 0.5
    elif spec["engine"] == "tenantkv-staged-64k":  # bench/vllm_hit_phases.py's
        from tenantkv.storage import local

        local.MAPPED_SEGMENT_BYTES = 128 * 1024  # the 64 KiB segments read into a slot again
    elif spec["engine"] == "tenantkv-token-rows":  # both benchmarks'
        _store_token_rows()
    elif spec["engine"] == "tenantkv-window-from-consumed":  # both benchmarks'
        from _fixtures import next_layer_counted_from_consumption

        from tenantkv.datapath.schedule import Schedule

        Schedule.next_layer = next_layer_counted_from_consumption  # type: ignore[method-assign]
    transfer = None
    if spec["engine"].startswith("tenantkv"):
        transfer = KVTransferConfig(
            kv_connector="TenantKVConnector",
            kv_connector_module_path="tenantkv.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["extra"],
        )
    elif spec["engine"] == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config=spec["extra"],
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        block_size=BLOCK_TOKENS,
        kv_transfer_config=transfer,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        disable_hybrid_kv_cache_manager=True,
        seed=0,
    )
    extra_args = {"kv_transfer_params": spec["params"]} if spec.get("params") else None
    sampling = SamplingParams(max_tokens=1, temperature=0, detokenize=False, extra_args=extra_args)

    # no assertion: tenantkv's connector gives the request no cache (no lookup, no save), so
    # it is a plain prefill in the same engine process, timed beside each miss
    plain = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    return llm, sampling, plain


def worker(spec_path: str) -> None:
    """One engine: build the LLM, run every (length, rep) miss then hit, print the timings."""
    spec = json.loads(Path(spec_path).read_text())
    llm, sampling, plain = build_llm(spec)
    from vllm.inputs import TokensPrompt

    def ttft(prompt: list[int], params: Any = sampling) -> tuple[float, int, int]:
        started = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        return time.perf_counter() - started, out.outputs[0].token_ids[0], out.num_cached_tokens

    ttft(list(range(1, 100)))  # warm up: first-call costs are not the connector's
    results: dict[str, dict[str, list[float]]] = {}
    for length in spec["lengths"]:
        times: dict[str, list[float]] = {"miss": [], "hit": []}
        for rep in range(spec["reps"]):
            prompt = fresh_prompt(length, rep, spec.get("round", 0))
            in_process = spec["engine"].startswith("tenantkv")
            other = [(t + 2003) % 4000 + 1 for t in prompt]  # another fresh prompt
            if in_process and rep % 2 == 1:  # alternate: plain first on odd reps
                times.setdefault("plain", []).append(ttft(other, plain)[0])
            miss, first, cached_miss = ttft(prompt)
            hit, again, cached_hit = ttft(prompt)
            later, third, cached_later = ttft(prompt)  # a later turn: the save long done
            if in_process and rep % 2 == 0:
                times.setdefault("plain", []).append(ttft(other, plain)[0])
            assert cached_miss == 0, f"{spec['engine']}: a fresh prompt hit {cached_miss}"
            expected = cached_on_hit(length) if spec["engine"] != "none" else 0
            assert cached_hit == expected, f"{spec['engine']}: hit {cached_hit} != {expected}"
            assert cached_later == expected, f"{spec['engine']}: {cached_later} != {expected}"
            assert first == again == third, f"{spec['engine']}: the hit changed the first token"
            times["miss"].append(miss)
            times["hit"].append(hit)
            times.setdefault("hit-again", []).append(later)
        results[str(length)] = times
    print("BENCH " + json.dumps(results), flush=True)
    os._exit(0)


def run_engine(
    engine: str,
    model: Path,
    work: Path,
    lengths: list[int],
    reps: int,
    round_: int = 0,
    engine_core: str = "in-process",
    script: str = __file__,
) -> Any:
    """Run ``script --worker SPEC`` for one engine (a cache and an assertion made for tenantkv's
    engines) and return what it printed after ``BENCH``."""
    spec: dict[str, Any] = {"engine": engine, "model": str(model), "lengths": lengths}
    spec["reps"], spec["round"], spec["engine_core"] = reps, round_, engine_core
    work = work / f"round-{round_}"
    work.mkdir(exist_ok=True)
    if engine == "example":
        spec["extra"] = {"shared_storage_path": str(work / "example-store")}
    elif engine.startswith("tenantkv"):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        import tenantkv
        from tenantkv.tenant_assertion import AssertionSigner, public_key_pem

        root = work / engine
        with tenantkv.open(root) as kv:
            kv.create_tenant("bench", quota_bytes=8 << 30)
        signer = AssertionSigner(Ed25519PrivateKey.generate())
        spec["extra"] = {
            "root": str(root),
            "gateway_public_keys": [public_key_pem(signer.public_key).decode("ascii")],
            "model": "bench-llama",
            "max_assertion_lifetime": 3600,
        }
        if engine == "tenantkv-buffered":  # extents written through the page cache
            spec["extra"]["open_options"] = {"direct_writes": False}
        elif engine == "tenantkv-before-forward":  # each load whole, before the forward
            spec["extra"]["layer_wise"] = False
        spec["params"] = {"tenantkv_assertion": signer.sign("bench", ttl=3600)}
    path = work / f"{engine}.json"
    path.write_text(json.dumps(spec))
    errors = work / f"{engine}.stderr"
    # A session of its own: once the worker has printed its figures, the whole session goes,
    # the engine core's processes (``separate``) with it, which would otherwise outlive the
    # worker's ``os._exit`` holding its stdout open.
    with open(errors, "w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, script, "--worker", str(path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        found = None
        assert worker.stdout is not None
        for line in worker.stdout:
            if line.startswith("BENCH "):
                found = line
                break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    if found is None:
        sys.exit(f"engine {engine} failed:\n{errors.read_text()[-3000:]}")
    return json.loads(found.removeprefix("BENCH "))


def plot(results: dict[str, Any], lengths: list[int], path: Path) -> None:
    from _plots import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(7, 4))
    for engine in ENGINES:
        for kind, style in (("miss", "--"), ("hit", "-")):
            if engine not in results or (engine == "none" and kind == "hit"):
                continue
            medians = [statistics.median(results[engine][str(n)][kind]) * 1000 for n in lengths]
            ax.plot(lengths, medians, style, marker="o", label=f"{engine} {kind}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, median ms")
    ax.set_title("vLLM (CPU) time to first token, by KV connector")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    from _cli import bench_parser, int_list, write_outputs
    from _common import format_stats_table, print_machine

    parser = bench_parser(__doc__, reps=3, data_dir=False)
    parser.add_argument("--lengths", type=int_list, default="256,1024,2048")
    parser.add_argument(
        "--engines",
        default=DEFAULT_ENGINES,
        help=f"engines to run, comma-separated, from {','.join(ENGINES)} (default"
        f" {DEFAULT_ENGINES}; ratios of engines not run are left out)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="engine passes, the order reversed every other pass (reps per pass = reps)",
    )
    parser.add_argument(
        "--engine-core",
        choices=("in-process", "separate"),
        default="in-process",
        help="vLLM's engine core in the benchmark's process (LLM in a script) or in processes"
        " of its own (as vllm serve runs it)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    lengths = args.lengths
    with tempfile.TemporaryDirectory(prefix="tkv-engines-bench-") as tmp:
        work = Path(tmp)
        print_machine(tmp)
        model = work / "model"
        write_model(model)
        # alternate the engines' order from round to round: a drift of the shared machine's
        # load then weighs on every engine alike
        results: dict[str, Any] = {}
        for round_ in range(max(1, args.rounds)):
            chosen = tuple(e for e in ENGINES if e in args.engines.split(","))
            order = chosen if round_ % 2 == 0 else tuple(reversed(chosen))
            for engine in order:
                got = run_engine(engine, model, work, lengths, args.reps, round_, args.engine_core)
                empty: dict[str, dict[str, list[float]]] = {str(n): {} for n in lengths}
                merged = results.setdefault(engine, empty)
                for n in lengths:
                    for kind, values in got[str(n)].items():
                        merged[str(n)].setdefault(kind, []).extend(values)
    rows = []
    for n in lengths:
        for engine in ENGINES:
            if engine not in results:
                continue
            for kind in ("miss", "hit", "hit-again", "plain"):
                if kind not in results[engine][str(n)] or (
                    engine == "none" and kind.startswith("hit")
                ):
                    continue
                values = [v * 1000 for v in results[engine][str(n)][kind]]
                rows.append((f"{n:>5} tok  {engine:<21} {kind}", values, ""))
    print()
    print(format_stats_table(rows, "ms", label="prompt  engine  request", digits=1))
    print()
    print("ratios of medians (same run):")
    for n in lengths:

        def med(engine: str, kind: str, n: int = n) -> float:
            return statistics.median(results[engine][str(n)][kind])

        def turn(engine: str) -> float:  # a prompt stored, then reused: miss + hit
            return med(engine, "miss") + med(engine, "hit")

        pairs = {  # name: (numerator, denominator), each (engine, kind)
            "tenantkv hit/miss": (("tenantkv", "hit"), ("tenantkv", "miss")),
            "example hit/miss": (("example", "hit"), ("example", "miss")),
            "tenantkv hit / example hit": (("tenantkv", "hit"), ("example", "hit")),
            # a later turn's hit: the miss's background save long done on both sides
            "tenantkv hit-again / example hit-again": (
                ("tenantkv", "hit-again"),
                ("example", "hit-again"),
            ),
            "buffered hit / example hit": (("tenantkv-buffered", "hit"), ("example", "hit")),
            "tenantkv hit-again / openmp-teams'": (
                ("tenantkv", "hit-again"),
                ("tenantkv-openmp-teams", "hit-again"),
            ),
            "openmp-teams hit-again / example's": (
                ("tenantkv-openmp-teams", "hit-again"),
                ("example", "hit-again"),
            ),
            "before-forward hit-again / example's": (
                ("tenantkv-before-forward", "hit-again"),
                ("example", "hit-again"),
            ),
            "before-forward hit-again / tenantkv's": (
                ("tenantkv-before-forward", "hit-again"),
                ("tenantkv", "hit-again"),
            ),
            "tenantkv hit-again / token-rows'": (
                ("tenantkv", "hit-again"),
                ("tenantkv-token-rows", "hit-again"),
            ),
            "token-rows hit-again / example's": (
                ("tenantkv-token-rows", "hit-again"),
                ("example", "hit-again"),
            ),
            "tenantkv hit / prefill": (("tenantkv", "hit"), ("none", "miss")),
            "tenantkv miss / prefill": (("tenantkv", "miss"), ("none", "miss")),
            # the same engine process, plain requests alternating with the misses: robust to
            # the machine's load drifting between engine processes
            "tenantkv miss / in-process prefill": (("tenantkv", "miss"), ("tenantkv", "plain")),
            "tenantkv hit / in-process prefill": (("tenantkv", "hit"), ("tenantkv", "plain")),
            "openmp-teams miss / in-process prefill": (
                ("tenantkv-openmp-teams", "miss"),
                ("tenantkv-openmp-teams", "plain"),
            ),
        }
        ratios = {
            name: med(*top) / med(*bottom)
            for name, (top, bottom) in pairs.items()
            if top[0] in results and bottom[0] in results
        }
        for name, engine in (("tenantkv", "tenantkv"), ("buffered", "tenantkv-buffered")):
            if engine in results and "example" in results:
                ratios[f"miss+hit: {name} / example"] = turn(engine) / turn("example")
        print(f"  {n:>5} tok: " + "  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    write_outputs(
        args.out, "engines_vllm", results, lambda png: plot(results, lengths, png), indent=1
    )


if __name__ == "__main__":
    main()
