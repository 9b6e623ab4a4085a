#!/usr/bin/env python3
"""vLLM's worker-side connector alone: a hit's load into the engine's pages and a save from
them, timed without a model, so that the connector's own work is not lost in a prefill's noise.

The same shapes as ``bench/engines_vllm.py`` (8 layers, 4 KV heads of 64, fp32, 32-token
blocks; vLLM's CPU pages ``[blocks, heads, tokens, K|V]``, 256 pages a layer), the real
connector built from a real ``VllmConfig`` (``TenantKVConnector``, worker role), the cache's
defaults. Per prompt length and rep, a fresh prompt is stored, then:

* **load**: ``start_load_kv`` with one request's ``LoadSpec`` and ``wait_for_layer_load`` for
  every layer, as a forward step calls them (the stream's read and decryption included: what
  a hit costs the step); every loaded page is then compared with the stored rows;
* **save**: ``save_kv_layer`` for every layer, ``wait_for_save``, then the background save
  drained (gather from the pages and store: what a miss leaves for the background).

Pages are ``consecutive`` (vLLM's usual allocation) or ``scattered`` (a random set).

``--engine-has-blocks K``: vLLM's own prefix cache holds each prompt's first ``K`` blocks (the
load's ``first_block``): their pages hold marker values the load must leave as they are, and
the load fills the pages after them (checked too).

``--layout mla``: a DeepSeek-style latent instead (8 layers of 512 + 64 bf16 values a token,
vLLM's CPU MLA pages ``[blocks, tokens, latent]``), where a load decrypts straight into the
pages.

With ``--baseline DIR`` (a tree whose ``tenantkv`` package is another version, e.g.
``git archive`` of the base commit with crypto, storage and audit inside it and the built
extensions copied), each round runs this version and that one in fresh processes, alternating
which goes first, and reports each version's medians and their ratio in the same run.

Run (in the engine venv):
    .venv-engines/bin/python bench/engines_vllm_worker.py [--lengths 256,1024,2048] \
        [--reps 5] [--rounds 4] [--layout mha|mla] [--engine-has-blocks K] [--baseline DIR] \
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

LAYERS, HEADS, HEAD_DIM, BLOCK, PAGES = 8, 4, 64, 32, 256
RANK, ROPE = 512, 64  # --layout mla: DeepSeek-V3's latent


def write_deepseek(directory: Path) -> None:
    """A random 8-layer DeepSeek-V2 (MLA) small enough to write in a second; the connector
    reads only its config."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=RANK,
        q_lora_rank=None,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=LAYERS,
        max_position_embeddings=4096,
        torch_dtype="float32",
    )
    DeepseekV2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One version in one process: every (layout of pages, length, rep), load then save."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    import tenantkv
    from tenantkv.integrations.engine_identity import RequestTenant
    from tenantkv.integrations.vllm import TenantKVConnector
    from tenantkv.integrations.vllm.metadata import LoadSpec, SaveSpec, TenantKVConnectorMetadata
    from tenantkv.tenant_assertion import AssertionSigner, public_key_pem

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    mla = spec["layout"] == "mla"
    attention = (
        MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=RANK + ROPE, dtype=torch.bfloat16
        )
        if mla
        else FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
    )
    kv_config = KVCacheConfig(
        num_blocks=PAGES, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, attention)]
    )
    signer = AssertionSigner(Ed25519PrivateKey.generate())
    extra = {
        "root": spec["root"],
        "gateway_public_keys": [public_key_pem(signer.public_key).decode("ascii")],
        "model": "bench-llama",
    }
    config = VllmConfig(
        model_config=ModelConfig(
            model=spec["model"], dtype="float32", seed=0, skip_tokenizer_init=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=1,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TenantKVConnector",
            kv_connector_module_path="tenantkv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    connector = TenantKVConnector(config, KVConnectorRole.WORKER, kv_config)
    kv = connector.engine.kv
    if "bench" not in {t.name for t in kv.list_tenants()}:
        kv.create_tenant("bench", quota_bytes=8 << 30)
    owner = RequestTenant("bench", None)
    namespace = connector.engine.namespace(owner)
    assert namespace is not None
    if mla:  # as vLLM's CPU MLA layers hold them
        pages = {
            name: torch.zeros(PAGES, BLOCK, RANK + ROPE, dtype=torch.bfloat16) for name in names
        }
    else:
        pages = {name: torch.zeros(PAGES, HEADS, BLOCK, 2 * HEAD_DIM) for name in names}
    connector.register_kv_caches(pages)
    forward = SimpleNamespace(no_compile_layers={})
    picker = random.Random(spec["seed"])
    generator = torch.Generator().manual_seed(spec["seed"])
    times: dict[str, dict[str, dict[str, list[float]]]] = {}
    counter = 0

    def step(meta: Any, body: Any) -> float:
        connector.bind_connector_metadata(meta)
        started = time.perf_counter()
        body()
        connector.wait_for_save()
        if meta.saves:
            connector.worker_side.saves.drain()
        elapsed = time.perf_counter() - started
        errors = connector.get_block_ids_with_load_errors()
        assert not errors, f"load errors: {sorted(errors)}"
        connector.clear_connector_metadata()
        return elapsed

    # one untimed cycle first (first-call costs), then every timed cell
    plan = [("consecutive", spec["lengths"][0], False)]
    plan += [(p, n, True) for p in ("consecutive", "scattered") for n in spec["lengths"]]
    for placement, length, timed in plan:
        cell = times.setdefault(placement, {}).setdefault(str(length), {}) if timed else {}
        blocks = length // BLOCK
        for _ in range(spec["reps"] if timed else 1):
            counter += 1
            tokens = [(spec["seed"] * 7919 + counter * 4099 + i) % 30000 for i in range(length)]
            if placement == "consecutive":
                first = picker.randrange(PAGES - blocks)
                block_ids = tuple(range(first, first + blocks))
            else:
                block_ids = tuple(picker.sample(range(PAGES), blocks))
            if mla:
                rows = torch.randn(LAYERS, length, RANK + ROPE, generator=generator)
                rows = rows.to(torch.bfloat16)
                layers: list[Any] = list(rows)
            else:
                rows = torch.randn(LAYERS, length, HEADS, 2 * HEAD_DIM, generator=generator)
                if namespace.layout.kind == "mha-pages":  # stored as vLLM's pages hold them
                    layers = [
                        r.view(blocks, BLOCK, HEADS, -1).transpose(1, 2).contiguous() for r in rows
                    ]
                else:  # token rows (KVLayout.mha), as the connector stored MHA before
                    layers = [(r[..., :HEAD_DIM], r[..., HEAD_DIM:]) for r in rows]
            assert namespace.store(tokens, layers) == length
            held = spec.get("engine_has", 0)  # blocks vLLM's prefix cache holds: not loaded
            for name in names:
                pages[name][list(block_ids[:held])] = -1.0
            load = LoadSpec(f"load-{counter}", owner, tuple(tokens), block_ids, held, False)

            def load_layers() -> None:
                connector.start_load_kv(forward)
                for name in names:
                    connector.wait_for_layer_load(name)

            cell.setdefault("load", []).append(
                step(TenantKVConnectorMetadata(loads=[load]), load_layers)
            )
            for index, name in enumerate(names):  # every loaded byte checked
                got = pages[name][list(block_ids[held:])]
                if mla:
                    want = rows[index].view(blocks, BLOCK, -1)
                else:
                    want = rows[index].view(blocks, BLOCK, HEADS, -1).transpose(1, 2)
                assert torch.equal(got, want[held:]), (placement, length, name)
                kept = pages[name][list(block_ids[:held])]
                assert bool((kept == -1.0).all()), (placement, length, name, "rewritten")
            # the save: another fresh prompt, from the same pages
            save_tokens = [(t + 15013) % 30000 for t in tokens]
            save = SaveSpec(f"save-{counter}", owner, tuple(save_tokens), block_ids, 0)

            def save_layers() -> None:
                for name in names:
                    connector.save_kv_layer(name, pages[name], None)

            cell.setdefault("save", []).append(
                step(TenantKVConnectorMetadata(saves=[save]), save_layers)
            )
            assert namespace.cached_length(save_tokens) == length
    connector.shutdown()
    tenantkv_path = str(Path(tenantkv.__file__).parent)
    return {"times": times, "tenantkv": tenantkv_path}


def run_version(
    version: str, baseline: Path | None, spec: dict[str, Any], work: Path
) -> dict[str, Any]:
    env = dict(os.environ)
    if version == "baseline":
        assert baseline is not None
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline), env.get("PYTHONPATH")]))
    spec = {**spec, "root": str(work / version)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parent,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{version} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def main() -> None:
    from _cli import bench_parser, int_list
    from _common import format_stats_table, print_machine
    from engines_vllm import write_model

    parser = bench_parser(__doc__, reps=5, data_dir=False)
    parser.add_argument("--lengths", type=int_list, default="256,1024,2048")
    parser.add_argument("--rounds", type=int, default=4, help="processes per version")
    parser.add_argument("--baseline", type=Path, help="a tree with another tenantkv version")
    parser.add_argument("--layout", choices=("mha", "mla"), default="mha")
    parser.add_argument(
        "--engine-has-blocks", type=int, default=0, help="blocks vLLM's prefix cache holds (0)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        os._exit(0)  # vLLM's threads need not be joined
    if any(n % BLOCK or n // BLOCK > PAGES for n in args.lengths):
        sys.exit(f"lengths must be multiples of {BLOCK} up to {BLOCK * PAGES} tokens")
    if not 0 <= args.engine_has_blocks < min(args.lengths) // BLOCK:
        sys.exit("--engine-has-blocks must leave at least one block of every length to load")
    versions = ["this"] + (["baseline"] if args.baseline else [])
    results: dict[str, Any] = {v: {} for v in versions}
    paths: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-vllm-worker-") as tmp:
        work = Path(tmp)
        print_machine(tmp)
        model = work / "model"
        if args.layout == "mla":
            write_deepseek(model)
        else:
            write_model(model)
        for round_ in range(max(1, args.rounds)):
            order = versions if round_ % 2 == 0 else versions[::-1]
            for version in order:
                spec = {"model": str(model), "lengths": args.lengths, "reps": args.reps}
                spec["layout"] = args.layout
                spec["engine_has"] = args.engine_has_blocks
                spec["seed"] = round_
                got = run_version(version, args.baseline, spec, work / f"round-{round_}")
                paths[version] = got["tenantkv"]
                for placement, by_length in got["times"].items():
                    for n, kinds in by_length.items():
                        for kind, values in kinds.items():
                            cell = results[version].setdefault(placement, {}).setdefault(n, {})
                            cell.setdefault(kind, []).extend(values)
            print(f"round {round_ + 1} done ({time.strftime('%H:%M:%S')}, load {os.getloadavg()})")
    print("tenantkv imported from: " + ", ".join(f"{v} {p}" for v, p in paths.items()))
    rows = []
    for placement in ("consecutive", "scattered"):
        for n in map(str, args.lengths):
            for kind in ("load", "save"):
                for version in versions:
                    values = [v * 1000 for v in results[version][placement][n][kind]]
                    label = f"{placement:<11} {n:>5} tok {kind} {version}"
                    rows.append((label, values, ""))
    print()
    print(format_stats_table(rows, "ms", label="pages  prompt  op  version", digits=2))
    if args.baseline:
        print("\nthis / baseline, ratios of medians (same run):")
        for placement in ("consecutive", "scattered"):
            for n in map(str, args.lengths):
                parts = []
                for kind in ("load", "save"):
                    this = statistics.median(results["this"][placement][n][kind])
                    base = statistics.median(results["baseline"][placement][n][kind])
                    parts.append(f"{kind} {this / base:.2f}")
                print(f"  {placement:<11} {n:>5} tok: " + "  ".join(parts))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "engines_vllm_worker.json"
    path.write_text(json.dumps({"results": results, "imported_from": paths}, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
