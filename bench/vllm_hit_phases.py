#!/usr/bin/env python3
"""vLLM on CPU: where a later turn's hit spends its time, tenantkv's connector against vLLM's
ExampleConnector, phase by phase.

The model, engine settings and prompts are ``bench/engines_vllm.py``'s (a random 8-layer Llama,
vLLM's CPU backend, its engine core in this process, one request at a time). For each prompt
length, a fresh prompt is sent twice untimed (its miss stores it, its first hit waits for the
save), then ``--reps`` later turns of it are timed one after another: each hit's whole time
(``hit``) and, inside it, the time spent in each of these calls, summed per hit:

* ``lookup``: the connector's ``get_num_new_matched_tokens`` (scheduler side);
* ``start load``: the connector's ``start_load_kv`` (tenantkv: the namespace's lookup, plan,
  lease and readers; ExampleConnector: its whole load, every layer read and written into the
  pages);
* ``layer waits``: the connector's ``wait_for_layer_load``, all layers (tenantkv: waiting for
  the decrypting workers and one copy of each layer into the pages; ExampleConnector: none);
* ``forward``: the model's forward (``GPUModelRunner._model_forward``), the layer waits
  included.

Engines (``--engines``), each in a process of its own, the order reversed every other round:
``example``, ``tenantkv`` (this code, its defaults), and variants of the same connector, the
baselines each with one earlier choice put back:

* ``tenantkv-openmp-teams`` (in the default set): the cache's threads run torch's kernels with
  torch's default OpenMP count, so each that runs a parallel kernel starts an OpenMP team of its
  own, and libgomp, then managing more threads than CPUs, has every team's threads (the
  model's too) sleep at barriers instead of spinning (``tenantkv/openmp_threads.py``);
* ``tenantkv-books-20ms``: the bookkeeping delay before the quarter-second batches
  (``BOOKKEEPING_DELAY_S`` 20 ms, ``BOOKKEEPING_HOLD_S`` 0.5 s): every load's record of use
  then written in a transaction of its own, beside the next step;
* ``tenantkv-before-forward``: not a baseline but the connector's other load mode
  (``layer_wise=False``): each hit's whole load in ``start_load_kv``, so ``start load`` holds
  it and the forward runs with no load beside it;
* ``tenantkv-staged-64k``: the 64 KiB segments of the benchmark's model (32-token blocks) read
  into a staging slot with ``preadv`` before they are decrypted, as they were while only
  segments of 128 KiB and more were opened out of a mapping (``MAPPED_SEGMENT_BYTES``);
* ``tenantkv-token-rows``: MHA layers stored as token rows (``KVLayout.mha``), as before the
  connector kept them as vLLM's pages (``mha-pages``): each layer decrypted into a tensor,
  then copied into the pages head by head;
* ``tenantkv-window-from-consumed``: a load's read-ahead window (``window`` layers, 2 on a
  2-core machine) counted from the layers the caller consumed alone, as before it followed the
  layer the caller waits for: the connector's layer hooks wait and never consume, so the
  loader stopped two layers in and loaded each later layer once the forward was blocked on it.

Reported: min / median / max ms per (length, engine, phase), the ratios of the medians of
whole hits (each engine / example, tenantkv / each baseline), and a PNG of the hits and their
phases. And the encryption's own floor, measured in the same run: the time one thread takes to
open (AES-256-GCM, ``ExtentCipher.open_many_into``) the segments a hit loads, alone; where the
forward keeps both of a 2-core machine's CPUs busy, each millisecond of it is a millisecond of
the hit, so ``(example hit + AEAD) / example hit`` is the lowest ratio an encrypted load can
reach there.

Run (in the engine venv, scripts/setup_engines.sh):
    .venv-engines/bin/python bench/vllm_hit_phases.py [--lengths 256,1024] [--reps 30] \\
        [--rounds 4] [--engines example,tenantkv,tenantkv-openmp-teams] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import engines_vllm

ENGINES = (
    "example",
    "tenantkv",
    "tenantkv-openmp-teams",
    "tenantkv-books-20ms",
    "tenantkv-staged-64k",
    "tenantkv-before-forward",
    "tenantkv-token-rows",
    "tenantkv-window-from-consumed",
)
DEFAULT_ENGINES = "example,tenantkv,tenantkv-openmp-teams"
PHASES = ("hit", "lookup", "start load", "layer waits", "forward")


def _timed(owner: type, name: str, phase: str, spent: dict[str, float]) -> None:
    """Wrap ``owner.name`` so that each call adds its wall time to ``spent[phase]``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[phase] += time.perf_counter() - started

    setattr(owner, name, timed)


def _watch_phases(engine: str, spent: dict[str, float]) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _timed(GPUModelRunner, "_model_forward", "forward", spent)
    if engine.startswith("tenantkv"):
        from tenantkv.integrations.vllm.connector import TenantKVConnector as connector
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector as connector,
        )
    _timed(connector, "get_num_new_matched_tokens", "lookup", spent)
    _timed(connector, "start_load_kv", "start load", spent)
    _timed(connector, "wait_for_layer_load", "layer waits", spent)


def worker(spec_path: str) -> None:
    """One engine: for each length, a prompt's miss and first hit, then the timed later turns."""
    spec = json.loads(Path(spec_path).read_text())
    spent: dict[str, float] = defaultdict(float)
    _watch_phases(spec["engine"], spent)
    llm, sampling, _plain = engines_vllm.build_llm(spec)
    from vllm.inputs import TokensPrompt

    def request(prompt: list[int]) -> int:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
        return int(out.num_cached_tokens)

    request(list(range(1, 100)))  # warm up: first-call costs are not the connector's
    results: dict[str, dict[str, list[float]]] = {}
    for length in spec["lengths"]:
        prompt = engines_vllm.fresh_prompt(length, 0, spec["round"])
        request(prompt)  # the miss: stored
        request(prompt)  # the first hit: waits for the save
        expected = engines_vllm.cached_on_hit(length)
        times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        for _ in range(spec["reps"]):
            spent.clear()
            started = time.perf_counter()
            cached = request(prompt)
            times["hit"].append(time.perf_counter() - started)
            assert cached == expected, f"{spec['engine']}: hit {cached} != {expected}"
            for phase in PHASES[1:]:
                times[phase].append(spent.get(phase, 0.0))
        results[str(length)] = times
    print("BENCH " + json.dumps(results), flush=True)
    os._exit(0)


def aead_ms(length: int, rounds: int = 15) -> float:
    """Median ms for one thread to open the segments a later turn of ``length`` tokens loads
    (every layer's full blocks before the last token), as the loader opens them."""
    import secrets

    from tenantkv.crypto import TAG_BYTES, CipherSuite, ExtentCipher
    from tenantkv.crypto.segment import SegmentContext

    layout = engines_vllm.kv_layout()
    size = layout.segment_bytes(engines_vllm.BLOCK_TOKENS)
    blocks = engines_vllm.cached_on_hit(length) // engines_vllm.BLOCK_TOKENS
    context = SegmentContext(secrets.token_bytes(16), 1, secrets.token_bytes(16))
    cipher = ExtentCipher(
        secrets.token_bytes(32), secrets.token_bytes(16), context, CipherSuite.AES_256_GCM
    )
    keys = [secrets.token_bytes(32) for _ in range(blocks)]
    plains = [memoryview(secrets.token_bytes(size))] * blocks
    sealed: list[memoryview] = []
    for layer in range(layout.num_layers):
        view = memoryview(bytearray((size + TAG_BYTES) * blocks))
        cipher.seal_many_into(0, layer, keys, plains, view)
        sealed.append(view)
    outs = [memoryview(bytearray(size)) for _ in range(blocks)]
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for layer, packed in enumerate(sealed):
            cipher.open_many_into(0, layer, keys, packed, outs)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def plot(results: dict[str, Any], engines: tuple[str, ...], lengths: list[int], path: Path) -> None:
    from _plots import horizontal_bars

    samples = {
        f"{n} tok {engine} {phase}": [v * 1000 for v in results[engine][str(n)][phase]]
        for n in lengths
        for engine in engines
        for phase in ("hit", "forward", "start load")
    }
    horizontal_bars(path, samples, "ms (median, whiskers min-max)", "vLLM (CPU) later-turn hit")


def main() -> None:
    from _cli import bench_parser, int_list, write_outputs
    from _common import format_stats_table, print_machine

    parser = bench_parser(__doc__, reps=30, data_dir=False)
    parser.add_argument("--lengths", type=int_list, default="256,1024")
    parser.add_argument("--rounds", type=int, default=4, help="engine passes (4)")
    parser.add_argument(
        "--engines",
        default=DEFAULT_ENGINES,
        help=f"comma-separated, from {','.join(ENGINES)} (default {DEFAULT_ENGINES})",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    lengths: list[int] = args.lengths
    engines = tuple(e for e in args.engines.split(",") if e)
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not {"example", "tenantkv"} <= set(engines):
        parser.error(f"--engines: needs example and tenantkv, knows {ENGINES}; got {engines}")
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-vllm-hit-") as tmp:
        work = Path(tmp)
        print_machine(tmp)
        model = work / "model"
        engines_vllm.write_model(model)
        for round_ in range(max(1, args.rounds)):
            order = engines if round_ % 2 == 0 else tuple(reversed(engines))
            for engine in order:
                got = engines_vllm.run_engine(
                    engine, model, work, lengths, args.reps, round_, script=__file__
                )
                merged = results.setdefault(engine, {str(n): {} for n in lengths})
                for n in lengths:
                    for phase, values in got[str(n)].items():
                        merged[str(n)].setdefault(phase, []).extend(values)
    rows = [
        (
            f"{n:>5} tok  {engine:<19} {phase}",
            [v * 1000 for v in results[engine][str(n)][phase]],
            "",
        )
        for n in lengths
        for engine in engines
        for phase in PHASES
    ]
    print()
    print(format_stats_table(rows, "ms", label="prompt  engine  phase", digits=1))
    print()
    print("ratios of median hits (same run):")
    for n in lengths:

        def hit(engine: str, n: int = n) -> float:
            return statistics.median(results[engine][str(n)]["hit"])

        ratios = [f"{e} / example {hit(e) / hit('example'):.2f}" for e in engines if e != "example"]
        ratios += [
            f"tenantkv / {e} {hit('tenantkv') / hit(e):.2f}"
            for e in engines
            if e not in ("example", "tenantkv")
        ]
        print(f"  {n:>5} tok: " + "  ".join(ratios))
    print("the encryption's floor (same run): one thread opening a hit's segments, alone")
    for n in lengths:
        example = statistics.median(results["example"][str(n)]["hit"]) * 1000
        opened = aead_ms(n)
        print(
            f"  {n:>5} tok: AEAD {opened:.2f} ms; (example hit {example:.1f} + AEAD) / example"
            f" hit {(example + opened) / example:.3f}"
        )
    write_outputs(
        args.out,
        "vllm_hit_phases",
        results,
        lambda png: plot(results, engines, lengths, png),
        indent=1,
    )


if __name__ == "__main__":
    main()
