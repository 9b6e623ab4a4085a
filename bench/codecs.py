#!/usr/bin/env python3
"""Latent codecs (none, fp8, int4): stored bytes, store/load tokens per second, and error.

Speed: for each prefix size (``--tokens``, default 8K and 32K) a DeepSeek-V3 MLA layout
(``--layers``, default 61) is stored and loaded through tenantkv in three namespaces of one
tenant, one per codec, round-robin (every round stores then loads once per codec, in an order
that rotates each round, so machine noise hits all alike). Store: a fresh prefix each round
(store of new blocks: encode, seal, write, index). Load (warm: the extents were read once,
untimed, before): lookup and a whole layer-wise load into fresh tensors, decoded into bf16.
Cold loads (``--cold``, root only): ``echo 3 > /proc/sys/vm/drop_caches`` before each load.
Tokens/s min / median / max and the ratio of medians to ``none`` measured in the same run.

Bytes: stored bytes per token per layer of each codec for DeepSeek-V3 and a Llama-3-8B-shaped
MHA layer (8 KV heads of 128).

Error (relative L2 error ``|x - x'| / |x|``): ``c_KV`` and ``k_rot`` of the tiny random
DeepSeek-V3 model the tests build, K and V of the tiny random Llama, both over a 256-token
prompt; synthetic DeepSeek-V3-shaped latents with heavy-tailed outlier channels; the attention
output for 64 random queries against the unquantized cache; and the agreement of 64 greedy
tokens generated after a restore (save, restore through tenantkv) with those after a full
prefill. A random model is a weak judge of quality: these say the codecs work as designed, not
what a trained model loses.

Run:  .venv/bin/python bench/codecs.py [--tokens 8192,32768] [--layers 61] [--reps 5] [--cold]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, int_list, write_outputs
from _common import format_stats_table, print_machine, tokens_label
from _fixtures import deepseek_layout, open_cache, random_layers, torch_tokens
from _plots import median_bars, pyplot, save_figure

import tenantkv
import tenantkv.codecs as codecs_module
from tenantkv.codecs import Component, _Int4Part

CODECS = ("none", "fp8", "int4")
LOSSY = ("fp8", "int4")


# ---- speed ---------------------------------------------------------------------------------------


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def speed(tokens: int, layers: int, reps: int, cold: bool, data_dir: Path) -> dict[str, Any]:
    layout = deepseek_layout(layers)
    results: dict[str, dict[str, list[float]]] = {
        c: {"store": [], "load": [], "load_cold": []} for c in CODECS
    }
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp, open_cache(Path(tmp) / "kv") as kv:
        kv.create_tenant("acme", quota_bytes=16 << 30)
        spaces = {c: kv.namespace("acme", model="m", layout=layout, codec=c) for c in CODECS}
        for rep in range(reps):
            order = CODECS[rep % 3 :] + CODECS[: rep % 3]
            for name in order:
                ns = spaces[name]
                prompt = torch_tokens(tokens, 1000 * rep + CODECS.index(name))
                layers_in = random_layers(layout, tokens, rep)
                started = time.perf_counter()
                assert ns.store(prompt, layers_in) == tokens
                results[name]["store"].append(tokens / (time.perf_counter() - started))
                del layers_in
                _load(ns, prompt, layout)  # warm: read once untimed
                started = time.perf_counter()
                _load(ns, prompt, layout)
                results[name]["load"].append(tokens / (time.perf_counter() - started))
                if cold:
                    _drop_caches()
                    started = time.perf_counter()
                    _load(ns, prompt, layout)
                    results[name]["load_cold"].append(tokens / (time.perf_counter() - started))
    return results


def _load(ns: Any, prompt: list[int], layout: Any) -> None:
    assert ns.lookup(prompt) == len(prompt)
    with ns.load(prompt) as stream:
        count = sum(1 for _ in stream)
    assert count == layout.num_layers


# ---- bytes ---------------------------------------------------------------------------------------


def bytes_table() -> list[tuple[str, str, float, float]]:
    rows = []
    shapes = {
        "DeepSeek-V3 MLA (512+64, bf16)": deepseek_layout(1),
        "Llama-3-8B MHA (8x128 K and V, bf16)": tenantkv.KVLayout.mha(1, 8, 128, torch.bfloat16),
    }
    for label, layout in shapes.items():
        base = layout.segment_bytes(64) / 64
        for c in CODECS:
            per = layout.with_codec(c).segment_bytes(64) / 64
            rows.append((label, c, per, base / per))
    return rows


# ---- error ---------------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _coded(layout: Any, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (values, whole 64-token blocks) as stored then loaded under the layout's codec."""
    codes = layout.coder.encode(layout, rows, 64)
    return layout.coder.decode(layout, codes, 64)


def _k_rot_int4(layout: Any, rows: torch.Tensor) -> torch.Tensor:
    """MLA ``k_rot`` coded in int4 too (the choice int4 does not make), for the comparison."""
    rank, rope = layout.kv_lora_rank, layout.rope_dim
    part = _Int4Part(Component("k_rot", rank, rope, rope, positional=False), 64)
    blocks = rows[:, rank:].float().reshape(-1, 64, rope)
    return part.decode(part.encode(blocks)).reshape(-1, rope)


def _attention_mla(layout: Any, rows: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA attention over the latent: scores ``q . [c_KV || k_rot]``, output
    ``softmax . c_KV`` (what the up-projections then act on)."""
    rows = rows.float()
    scores = queries @ rows.T / rows.shape[1] ** 0.5
    return torch.softmax(scores, dim=-1) @ rows[:, : layout.kv_lora_rank]


def _attention_mha(layout: Any, rows: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    heads, dim = layout.num_kv_heads, layout.head_dim
    kv = rows.float().view(-1, 2, heads, dim)
    k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [H, T, D]
    scores = queries @ k.transpose(1, 2) / dim**0.5  # [H, Q, T]
    return torch.softmax(scores, dim=-1) @ v


def _tiny_models() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_transformers_integration import _deepseek, _llama

    return {"tiny DeepSeek-V3": _deepseek(), "tiny Llama": _llama()}


def _captured_rows(model: Any, layout: Any, tokens: int) -> list[torch.Tensor]:
    """Each layer's cache of a ``tokens``-token random prompt, as layout rows (values)."""
    ids = torch.randint(
        0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():  # generate's own cache, as the integration's users save it
        cache = model.generate(
            ids, max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        ).cache
    rows = []
    for layer in cache.layers:
        keys, values = layer.keys[0, :, :tokens], layer.values[0, :, :tokens]
        if layout.kind == "mla":  # keys c_KV [1, T, rank], values k_rot [1, T, rope]
            rows.append(torch.cat((keys[0], values[0]), dim=-1))
        else:  # [H, T, D] each
            pair = torch.stack((keys.transpose(0, 1), values.transpose(0, 1)), dim=1)
            rows.append(pair.reshape(tokens, -1))
    return rows


def error_tables(greedy_tokens: int) -> dict[str, Any]:
    from tenantkv.integrations.transformers import PrefixCache, layout_for

    generator = torch.Generator().manual_seed(0)
    recon: list[tuple[str, str, str, float]] = []
    attention: list[tuple[str, str, float]] = []
    greedy: list[tuple[str, str, int, int]] = []
    models = _tiny_models()
    sources: dict[str, tuple[Any, list[torch.Tensor]]] = {}
    for label, model in models.items():
        layout = layout_for(model)
        sources[label] = (layout, _captured_rows(model, layout, 256))
    ds = deepseek_layout(1)
    heavy = torch.randn(4096, ds.values_per_token, generator=generator)
    outliers = torch.randperm(ds.kv_lora_rank, generator=generator)[:8]
    heavy[:, outliers] *= 40  # a few channels far above the rest, as real latents show
    heavy = heavy / heavy.std()
    sources["synthetic heavy-tailed (DeepSeek-V3 shape)"] = (ds, [heavy.bfloat16()])
    for label, (layout, layers) in sources.items():
        for codec in LOSSY:
            coded_layout = layout.with_codec(codec)
            errors: dict[str, list[float]] = {}
            attn: list[float] = []
            for rows in layers:
                back = _coded(coded_layout, rows.to(layout.dtype))
                for c in layout.components():
                    name = {"c_kv": "c_KV", "k_rot": "k_rot", "k": "K", "v": "V"}[c.name]
                    part = slice(c.start, c.start + c.width)
                    errors.setdefault(name, []).append(_rel(back[:, part], rows[:, part]))
                if layout.kind == "mla":
                    if codec == "int4":
                        errors.setdefault("k_rot if int4", []).append(
                            _rel(_k_rot_int4(layout, rows), rows[:, layout.kv_lora_rank :])
                        )
                    q = torch.randn(64, layout.values_per_token, generator=generator)
                    q = q * rows.float().std()  # queries on the keys' scale: peaked attention
                    attn.append(
                        _rel(_attention_mla(layout, back, q), _attention_mla(layout, rows, q))
                    )
                else:
                    q = torch.randn(layout.num_kv_heads, 64, layout.head_dim, generator=generator)
                    q = q * rows.float().std()
                    attn.append(
                        _rel(_attention_mha(layout, back, q), _attention_mha(layout, rows, q))
                    )
            for name, values in errors.items():
                recon.append((label, codec, name, sum(values) / len(values)))
            attention.append((label, codec, sum(attn) / len(attn)))
    # The int4 rotation's block: none (1), the scale group (32, the choice), the whole latent.
    rotation: list[tuple[int, float]] = []
    coded_ds = ds.with_codec("int4")
    for block in (1, 32, 512):
        codecs_module.MAX_ROTATION = block
        back = _coded(coded_ds, heavy.bfloat16())
        rank = ds.kv_lora_rank
        rotation.append((block, _rel(back[:, :rank], heavy.bfloat16()[:, :rank])))
    codecs_module.MAX_ROTATION = 32
    with tempfile.TemporaryDirectory() as tmp, tenantkv.open(Path(tmp) / "kv") as kv:
        kv.create_tenant("acme")
        for label, model in models.items():
            prompt = torch.randint(0, model.config.vocab_size, (1, 256), generator=generator)
            with torch.no_grad():
                full = model.generate(
                    prompt, max_new_tokens=greedy_tokens, do_sample=False, pad_token_id=0
                )[0, 256:]
            for codec in CODECS:
                prefixes = PrefixCache(kv, "acme", model, codec=codec)
                with torch.no_grad():
                    first = model.generate(
                        prompt,
                        max_new_tokens=1,
                        do_sample=False,
                        pad_token_id=0,
                        return_dict_in_generate=True,
                    )
                prefixes.save(first.sequences, first.cache)
                restored = prefixes.restore(prompt)
                assert restored.num_tokens == 192, restored.num_tokens  # 3 whole blocks of 256
                with torch.no_grad():
                    after = model.generate(
                        prompt,
                        cache=restored.cache,
                        max_new_tokens=greedy_tokens,
                        do_sample=False,
                        pad_token_id=0,
                    )[0, 256:]
                same = int((after == full).sum())
                differs = next((i for i in range(len(full)) if after[i] != full[i]), len(full))
                greedy.append((label, codec, same, differs))
    return {
        "reconstruction": recon,
        "attention": attention,
        "greedy": greedy,
        "rotation": rotation,
    }


# ---- report --------------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__, reps=5, layers=61)
    parser.add_argument("--tokens", type=int_list, default=[8192, 32768])
    parser.add_argument("--cold", action="store_true", help="also cold loads (needs root)")
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens compared (64)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-error", action="store_true")
    args = parser.parse_args()
    machine = print_machine(args.dir)
    print(f"load before: {_uptime()}")
    data: dict[str, Any] = {"machine": machine, "bytes": bytes_table()}
    print("\nstored bytes per token per layer")
    for label, codec, per, ratio in data["bytes"]:
        print(f"  {label:<40} {codec:<5} {per:9.2f} B   {ratio:5.2f}x fewer than none")
    speeds: dict[int, Any] = {}
    if not args.skip_speed:
        for tokens in args.tokens:
            speeds[tokens] = speed(tokens, args.layers, args.reps, args.cold, args.dir)
            res = speeds[tokens]
            print(
                f"\n{tokens_label(tokens)} tokens x {args.layers} layers, {args.reps} rounds "
                f"(load after: {_uptime()})"
            )
            rows = []
            for what in ("store", "load", "load_cold"):
                for c in CODECS:
                    if res[c][what]:
                        base = sorted(res["none"][what])[len(res["none"][what]) // 2]
                        mid = sorted(res[c][what])[len(res[c][what]) // 2]
                        rows.append(
                            (
                                f"{what} {c}",
                                [v / 1e3 for v in res[c][what]],
                                f"{mid / base:5.2f}x none",
                            )
                        )
            print(format_stats_table(rows, "Ktok/s", label="codec", note_header="median vs none"))
        data["speed"] = speeds
    if not args.skip_error:
        errors = error_tables(args.greedy)
        data["error"] = errors
        print("\nrelative reconstruction error (mean over layers; random models: a weak judge)")
        for label, codec, name, value in errors["reconstruction"]:
            print(f"  {label:<44} {codec:<5} {name:<14} {value:.4f}")
        print("\nattention output relative error, 64 random queries")
        for label, codec, value in errors["attention"]:
            print(f"  {label:<44} {codec:<5} {value:.4f}")
        print("\nint4 c_KV error on the heavy-tailed latents by rotation block")
        for block, value in errors["rotation"]:
            print(f"  rotation block {block:<4} {value:.4f}")
        print(f"\ngreedy tokens after a restore equal to a full prefill's (of {args.greedy})")
        for label, codec, same, first in errors["greedy"]:
            print(f"  {label:<20} {codec:<5} {same:3d} equal, first difference at {first}")

    def plot(png: Path) -> None:
        plt = pyplot()
        fig, axes = plt.subplots(1, max(1, len(speeds)), figsize=(6 * max(1, len(speeds)), 4))
        axes = axes if len(speeds) > 1 else [axes]
        for ax, (tokens, res) in zip(axes, speeds.items(), strict=True):
            for i, c in enumerate(CODECS):
                median_bars(
                    ax,
                    [j + 0.25 * i for j in range(2)],
                    [[v / 1e3 for v in res[c]["store"]], [v / 1e3 for v in res[c]["load"]]],
                    0.25,
                    label=c,
                )
            ax.set_xticks([0.25, 1.25], ["store", "load (warm)"])
            ax.set_ylabel("K tokens/s")
            ax.set_title(f"{tokens_label(tokens)} tokens x {args.layers} layers")
            ax.legend()
        save_figure(fig, png)

    write_outputs(args.out, "codecs", data, plot if speeds else None)


if __name__ == "__main__":
    main()
