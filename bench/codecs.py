#!/usr/bin/env python3
"""Latent codecs (none, fp8, int4): stored bytes, store/load tokens per second, and error.

Speed: for each prefix size (``--tokens``, default 8K and 32K) a DeepSeek-V3 MLA layout
(``--layers``, default 61) is stored once in each of three namespaces of one tenant, one per
codec (store tokens/s: encode, seal, write, index; one sample each), then loaded round-robin,
``--reps`` rounds, each in a codec order rotated from the last so that machine noise hits all
alike. Per round and codec:

* warm: lookup and a whole layer-wise load into the caller's ``out=`` buffers (an engine's: one
  set, faulted in once and zeroed untimed before each load), decoded into bf16 (the extents read
  once, untimed, before); every byte of every layer checked against the codec's own decode of
  the codes the store wrote (for ``none``: the stored values). Fresh tensors would time the
  kernel's page faults, which swung a warm ``none`` load from 1.7 to 97 K tokens/s in one run;
* cold: the same after the codec's extent files are dropped from the page cache (fsync, then
  ``POSIX_FADV_DONTNEED`` per file, as the peer benchmark's cold mode; the other codecs' stay
  warm), bytes checked the same; the share of the stored bytes each warm and cold load fetched
  from the device (``/proc/self/io``) is printed, ~0% warm and ~100% cold;
* host: the load with decoding skipped, chunks decrypted into the staging slot: what the host
  pays for a GPU load, which decodes on the device after the host-to-device copy;
* the write pass: one memset of the ``out=`` buffers (a layer a task on one thread per core).

The physical floor of a warm load into a CPU destination is then the host side (decryption of
the codec's stored bytes alone) plus the write pass of the decoded output; if that floor is
slower than ``none``'s warm load divided by the target (fp8 1.8x, int4 2.5x), no CPU decoder
can reach the target on this host, and the report says so with the figure. Tokens/s min /
median / max, and the ratio of medians to ``none`` in the same run; ``uptime`` before and after.

Decode: one layer of the first ``--tokens`` size decoded by the decoder before this change
(torch into a fresh tensor, then copied into the destination), today's torch path and the C
decoders (straight into the destination), ms min / median / max, rotated order, each checked.

Store encoders (``--store-ab``): each lossy codec stores a fresh prefix of the first ``--tokens``
size, ``--reps`` rounds, once by the CPU's C encoders and once by the torch encoders (what CUDA
tensors and installs without a C compiler run, and every CPU store before the C encoders), which
goes first alternating by round, with ``none`` in each round as the baseline; the stored bytes
of the two are checked equal. Store tokens/s min / median / max, and the ratio of medians.
Bytes: stored bytes per token per layer of each codec for DeepSeek-V3 and a Llama-3-8B-shaped
MHA layer (8 KV heads of 128).

Error (relative L2 error ``|x - x'| / |x|``): ``c_KV`` and ``k_rot`` of the tiny random
DeepSeek-V3 model the tests build, K and V of the tiny random Llama, both over a 256-token
prompt; synthetic DeepSeek-V3-shaped latents with heavy-tailed outlier channels; the attention
output for 64 random queries against the unquantized cache; and the agreement of 64 greedy
tokens generated after a restore (save, restore through tenantkv) with those after a full
prefill. A random model is a weak judge of quality: these say the codecs work as designed, not
what a trained model loses.

Run:  .venv/bin/python bench/codecs.py [--tokens 8192,32768] [--layers 61] [--reps 5] [--no-cold]
          [--skip-speed] [--skip-decode] [--skip-error] [--store-ab]
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from _cli import bench_parser, int_list, write_outputs
from _common import format_stats_table, print_machine, tokens_label
from _fixtures import deepseek_layout, open_cache, random_layers, torch_tokens
from _plots import median_bars, pyplot, save_figure

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from modes import evict_files  # the peer benchmark's cold mode: fadvise per file

import tenantkv
import tenantkv.codecs as codecs_module
from tenantkv.codecs import Component, _Int4Part

CODECS = ("none", "fp8", "int4")
LOSSY = ("fp8", "int4")
#: Warm-load tokens/s against ``none`` that issue 36 asks of each lossy codec.
TARGETS = {"fp8": 1.8, "int4": 2.5}


# ---- speed ---------------------------------------------------------------------------------------

#: The measurements of one round, per codec. ``host``: a load whose chunks are decrypted into the
#: staging slot and not decoded (what the host pays for a CUDA load, which decodes on the
#: device after the copy). ``write``: one write pass over a whole load's decoded output (the
#: layers a warm ``none`` load returned, all layers, both cores), the same for every codec.
KINDS = ("store", "warm", "cold", "host")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _read_bytes() -> int:
    """Bytes this process has had fetched from storage (``/proc/self/io``): a cold load's
    proof that it read the device."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _digest(layer: torch.Tensor) -> bytes:
    """A layer's bytes, hashed (a whole 32K-token load held twice does not fit beside the rest)."""
    data = layer.contiguous().view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).digest()


def _expected(layout: Any, layers: list[torch.Tensor]) -> list[bytes]:
    """The digest of each layer as a load must give it: the stored values for ``none``; for a
    lossy codec its own decode of the codes the store wrote (the encoder is deterministic), so
    the check is bit for bit, not against the originals."""
    digests = []
    for values in layers:
        if layout.encoded:
            codes = layout.coder.encode(layout, values, 64)
            values = layout.coder.decode(layout, codes, 64)
        digests.append(_digest(values))
    return digests


@contextlib.contextmanager
def _decode_skipped() -> Iterator[None]:
    """Loads in this block decrypt each chunk into the staging slot and leave it there: the
    host side of a CUDA load (decoding is queued on the device after the host-to-device copy,
    which this host has no device for). Nothing is decoded, so the destination's bytes are not
    checked; a wrong byte of the codes would still fail the load (the segments are AEAD)."""
    from tenantkv.datapath import load_targets

    real = load_targets.LoadTarget._decode
    load_targets.LoadTarget._decode = lambda self, output, first, codes: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        load_targets.LoadTarget._decode = real  # type: ignore[method-assign]


def _write_pass(writers: ThreadPoolExecutor, layers: list[torch.Tensor]) -> float:
    """Seconds of one memset over every layer, a layer a task on one thread per core (as the
    loader's workers share a load): the least a load that writes the decoded values costs
    beyond decryption. (torch's own fill_ runs on its OpenMP threads, whose barrier made it
    0.8 to 20 GB/s from run to run on the shared 2-core host.)"""

    def fill(layer: torch.Tensor) -> None:
        ctypes.memset(layer.data_ptr(), 0x3F, layer.numel() * layer.element_size())

    started = time.perf_counter()
    list(writers.map(fill, layers))
    return time.perf_counter() - started


def _timed_load(
    ns: Any, prompt: list[int], out: list[torch.Tensor], layout: Any
) -> tuple[float, list[torch.Tensor]]:
    """Zero ``out`` (untimed: a stale right answer cannot pass the check), then the seconds of a
    lookup and a whole layer-wise load into it, and the layers."""
    for buffer in out:
        buffer.view(torch.uint8).numpy().fill(0)
    started = time.perf_counter()
    assert ns.lookup(prompt) == len(prompt)
    with ns.load(prompt, out=out) as stream:
        layers = [layer for _, layer in stream]
    seconds = time.perf_counter() - started
    assert len(layers) == layout.num_layers
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(layers, out, strict=True))
    return seconds, layers


def speed(tokens: int, layers: int, reps: int, cold: bool, data_dir: Path) -> dict[str, Any]:
    """Per codec, tokens/s of each kind in ``KINDS`` (each round in another codec order), and
    the seconds of the write pass."""
    layout = deepseek_layout(layers)
    results: dict[str, Any] = {c: {k: [] for k in KINDS} for c in CODECS}
    results["write_seconds"] = []
    results["cold_fetched"] = {c: [] for c in CODECS}
    results["warm_fetched"] = {c: [] for c in CODECS}
    # No memory of recent writes (tenantkv.storage.recent_owners): warm is the page cache's
    # case and cold the device's, as in the peer benchmark, not a ring in RAM.
    with (
        tempfile.TemporaryDirectory(dir=data_dir) as tmp,
        open_cache(Path(tmp) / "kv", recent_writes_bytes=0) as kv,
    ):
        extents = Path(tmp) / "kv" / "blocks" / "extents"
        kv.create_tenant("acme", quota_bytes=64 << 30)
        spaces = {c: kv.namespace("acme", model="m", layout=layout, codec=c) for c in CODECS}
        stored = {c: tokens * layers * spaces[c].layout.segment_bytes(64) / 64 for c in CODECS}
        prompt = torch_tokens(tokens, 7)
        # The caller's own buffers, as an engine's: faulted in once, loaded into every time.
        out = [
            torch.zeros(tokens, layout.values_per_token, dtype=layout.dtype) for _ in range(layers)
        ]
        writers = ThreadPoolExecutor(len(os.sched_getaffinity(0)))
        expected: dict[str, list[bytes]] = {}
        files: dict[str, list[Path]] = {}  # each codec's extent files: its cold loads drop them
        for name in CODECS:  # each codec stores the same prefix once
            values = random_layers(layout, tokens, 7)
            before = set(extents.glob("*/*")) if extents.exists() else set()
            started = time.perf_counter()
            assert spaces[name].store(prompt, values) == tokens
            results[name]["store"].append(tokens / (time.perf_counter() - started))
            files[name] = sorted(set(extents.glob("*/*")) - before)
            rows = [v.view(tokens, -1) for v in values]
            expected[name] = _expected(spaces[name].layout, rows)
            del values, rows
            _timed_load(spaces[name], prompt, out, layout)  # warm: read once, untimed
        for rep in range(reps):
            order = CODECS[rep % 3 :] + CODECS[: rep % 3]
            for name in order:
                ns = spaces[name]
                fetched = _read_bytes()
                seconds, loaded = _timed_load(ns, prompt, out, layout)
                results["warm_fetched"][name].append((_read_bytes() - fetched) / stored[name])
                assert [_digest(t) for t in loaded] == expected[name], f"{name}: wrong bytes"
                results[name]["warm"].append(tokens / seconds)
                if name == "none":  # the write pass, over the same buffers
                    results["write_seconds"].append(_write_pass(writers, out))
                del loaded
                with _decode_skipped():
                    seconds, loaded = _timed_load(ns, prompt, out, layout)
                del loaded
                results[name]["host"].append(tokens / seconds)
                if cold:
                    evict_files(files[name])  # this codec's only: the others stay warm
                    fetched = _read_bytes()
                    seconds, loaded = _timed_load(ns, prompt, out, layout)
                    fetched = _read_bytes() - fetched
                    assert [_digest(t) for t in loaded] == expected[name], f"{name}: cold bytes"
                    del loaded
                    results[name]["cold"].append(tokens / seconds)
                    results["cold_fetched"][name].append(fetched / stored[name])
    return results


@contextlib.contextmanager
def _torch_encoders(on: bool) -> Iterator[None]:
    """The torch encoders (and decoders) in place of the C ones while ``on``."""
    kernels = codecs_module.kernels
    if on:
        codecs_module.kernels = None
    try:
        yield
    finally:
        codecs_module.kernels = kernels


def store_table(tokens: int, layers: int, reps: int, data_dir: Path) -> dict[str, list[float]]:
    """Store tokens/s of ``none`` and of each lossy codec by the C and by the torch encoders,
    each sample a fresh prefix in the codec's namespace, which encoder goes first alternating
    by round; the codes of the two ways are checked equal."""
    layout = deepseek_layout(layers)
    results: dict[str, list[float]] = {"none": []}
    for name in LOSSY:
        results[f"{name} C"], results[f"{name} torch"] = [], []
    with (
        tempfile.TemporaryDirectory(dir=data_dir) as tmp,
        open_cache(Path(tmp) / "kv", recent_writes_bytes=0) as kv,
    ):
        kv.create_tenant("acme", quota_bytes=64 << 30)
        spaces = {c: kv.namespace("acme", model="m", layout=layout, codec=c) for c in CODECS}
        seed = 100
        for rep in range(reps):
            ways = ("C", "torch") if rep % 2 == 0 else ("torch", "C")
            for name in CODECS:
                values = random_layers(layout, tokens, 7)
                for way in ways if name != "none" else ("C",):
                    seed += 1
                    prompt = torch_tokens(tokens, seed)
                    with _torch_encoders(way == "torch"):
                        started = time.perf_counter()
                        assert spaces[name].store(prompt, values) == tokens
                        elapsed = time.perf_counter() - started
                    results["none" if name == "none" else f"{name} {way}"].append(tokens / elapsed)
                if name != "none":
                    coded = spaces[name].layout
                    rows = values[0].view(tokens, -1)[: 64 * 4]
                    with _torch_encoders(True):
                        want = coded.coder.encode(coded, rows, 64)
                    assert torch.equal(coded.coder.encode(coded, rows, 64), want), name
                del values
    return results


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def floor_rows(res: dict[str, Any], tokens: int) -> list[tuple[str, float, float, float]]:
    """Per lossy codec: the physical floor of a warm load into a CPU destination (the host side of
    its load, decryption of its stored bytes, plus one write pass of the decoded output) as
    tokens/s, the best ratio to ``none``'s warm load that floor allows, and the ratio of the
    host side alone."""
    write = _median(res["write_seconds"])
    none_seconds = tokens / _median(res["none"]["warm"])
    rows = []
    for c in LOSSY:
        host_seconds = tokens / _median(res[c]["host"])
        floor = host_seconds + write
        rows.append((c, tokens / floor, none_seconds / floor, none_seconds / host_seconds))
    return rows


# ---- decode alone ------------------------------------------------------------------------------


def decode_table(tokens: int, reps: int) -> dict[str, dict[str, list[float]]]:
    """Milliseconds to decode one ``tokens``-token DeepSeek-V3 layer, per codec and decoder,
    each round in a rotated order: the decoder before this branch (tests/codec_reference.py:
    torch, into a fresh tensor, which a load then copied into its destination, also timed),
    today's torch path (CUDA tensors, installs without a C compiler) and the C decoders, both
    straight into the destination rows. Every result checked against the reference (fp8 bit
    for bit, int4 within the tolerance of tests/test_codec_kernels.py)."""
    layout = deepseek_layout(1)
    values = random_layers(layout, tokens, 11)[0]
    return {name: _decode_times(layout.with_codec(name), values, reps) for name in LOSSY}


def _decode_times(coded: Any, values: torch.Tensor, reps: int) -> dict[str, list[float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import codec_reference

    tokens = values.shape[0]
    out = torch.empty(tokens, coded.values_per_token, dtype=coded.dtype)
    starts = list(range(0, tokens, 64))
    built = codecs_module.kernels
    codes = coded.coder.encode(coded, values, 64)
    want = codec_reference.decode(coded, codes, 64)
    destinations = [(out, c.start) for c in coded.components()]

    def before() -> None:
        out.copy_(codec_reference.decode(coded, codes, 64))

    def torch_path() -> None:
        codecs_module.kernels = None
        try:
            coded.coder.decode_into(coded, codes, 64, destinations, starts)
        finally:
            codecs_module.kernels = built

    def c_path() -> None:
        coded.coder.decode_into(coded, codes, 64, destinations, starts)

    ways = {"before (torch, then copy)": before, "torch path": torch_path}
    if built is not None:
        ways["C decoder"] = c_path
    times: dict[str, list[float]] = {way: [] for way in ways}
    names = list(ways)
    for rep in range(reps):
        for way in names[rep % len(names) :] + names[: rep % len(names)]:
            out.zero_()
            started = time.perf_counter()
            ways[way]()
            times[way].append((time.perf_counter() - started) * 1e3)
            if coded.codec == "fp8":
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), way
            else:
                x, y = out.float(), want.float()
                bound = y.abs() * 2**-8 + y.abs().amax() * 2**-18
                assert bool(((x - y).abs() <= bound).all()), way
    return times


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
    parser.add_argument("--no-cold", action="store_true", help="skip the cold loads")
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens compared (64)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-decode", action="store_true", help="skip the decoder timings")
    parser.add_argument("--skip-error", action="store_true")
    parser.add_argument(
        "--store-ab", action="store_true", help="store tokens/s by the C and torch encoders"
    )
    args = parser.parse_args()
    machine = print_machine(args.dir)
    print(f"load before: {_uptime()}")
    data: dict[str, Any] = {"machine": machine, "bytes": bytes_table()}
    print("\nstored bytes per token per layer")
    for label, codec, per, ratio in data["bytes"]:
        print(f"  {label:<40} {codec:<5} {per:9.2f} B   {ratio:5.2f}x fewer than none")
    if not args.skip_decode:
        tokens = args.tokens[0]
        print(f"\ndecoding one {tokens_label(tokens)}-token layer (load before: {_uptime()})")
        data["decode"] = decode = decode_table(tokens, max(args.reps, 5))
        rows = []
        for name, ways in decode.items():
            first = _median(next(iter(ways.values())))
            for way, samples in ways.items():
                rows.append((f"{name} {way}", samples, f"{first / _median(samples):5.2f}x"))
        print(format_stats_table(rows, "ms", label="decoder", note_header="speed-up"))
        print(f"(load after: {_uptime()})")
    if args.store_ab:
        tokens = args.tokens[0]
        print(
            f"\nstoring {tokens_label(tokens)} tokens x {args.layers} layers by the C and the "
            f"torch encoders, {args.reps} rounds (load before: {_uptime()})"
        )
        data["store_ab"] = ab = store_table(tokens, args.layers, args.reps, args.dir)
        base = _median(ab["none"])
        rows = []
        for way, samples in ab.items():
            note = f"{_median(samples) / base:5.2f}x none"
            if way.endswith(" C"):
                torch_way = ab[way.replace(" C", " torch")]
                note += f", {_median(samples) / _median(torch_way):5.2f}x torch"
            rows.append((f"store {way}", [v / 1e3 for v in samples], note))
        print(format_stats_table(rows, "Ktok/s", label="codec", note_header="median"))
        print(f"(load after: {_uptime()})")
    speeds: dict[int, Any] = {}
    if not args.skip_speed:
        for tokens in args.tokens:
            label = f"{tokens_label(tokens)} tokens x {args.layers} layers"
            print(f"\n{label}: load before {_uptime()}")
            speeds[tokens] = res = speed(tokens, args.layers, args.reps, not args.no_cold, args.dir)
            print(
                f"{tokens_label(tokens)} tokens x {args.layers} layers, {args.reps} rounds "
                f"(load after: {_uptime()})"
            )
            rows = []
            for what in KINDS:
                base = res["none"][what]
                for c in CODECS:
                    if res[c][what]:
                        note = f"{_median(res[c][what]) / _median(base):5.2f}x none"
                        samples = [v / 1e3 for v in res[c][what]]
                        rows.append((f"{what} {c}", samples, note))
            print(format_stats_table(rows, "Ktok/s", label="codec", note_header="median vs none"))
            for what in ("warm", "cold"):
                if res[f"{what}_fetched"]["none"]:
                    fetched = ", ".join(
                        f"{c} {' '.join(f'{v:.0%}' for v in res[f'{what}_fetched'][c])}"
                        for c in CODECS
                    )
                    print(f"{what} loads fetched from storage (of the stored bytes): {fetched}")
            write = _median(res["write_seconds"])
            print(
                f"write pass of the decoded output ({tokens} x {args.layers} x 1,152 B): "
                f"median {write * 1e3:.1f} ms "
                f"({tokens * args.layers * 1152 / write / 1e9:.2f} GB/s)"
            )
            print(
                "floor of a warm load into a CPU destination (host side + write pass), against "
                f"warm none's median {_median(res['none']['warm']) / 1e3:.1f} Ktok/s:"
            )
            for c, floor, best, host in floor_rows(res, tokens):
                verdict = ""
                if c in TARGETS:
                    target = TARGETS[c]
                    verdict = (
                        f"target {target}x: out of reach on this host"
                        if best < target
                        else f"target {target}x: within the floor"
                    )
                print(
                    f"  {c:<5} {floor / 1e3:8.1f} Ktok/s  at best {best:5.2f}x none  "
                    f"(host side alone {host:5.2f}x)  {verdict}"
                )
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
        fig, axes = plt.subplots(1, max(1, len(speeds)), figsize=(7 * max(1, len(speeds)), 4))
        axes = axes if len(speeds) > 1 else [axes]
        kinds = [k for k in KINDS if all(speeds[t]["none"][k] for t in speeds)]
        for ax, (tokens, res) in zip(axes, speeds.items(), strict=True):
            for i, c in enumerate(CODECS):
                median_bars(
                    ax,
                    [j + 0.25 * i for j in range(len(kinds))],
                    [[v / 1e3 for v in res[c][k]] for k in kinds],
                    0.25,
                    label=c,
                )
            ax.set_xticks([j + 0.25 for j in range(len(kinds))], kinds)
            ax.set_ylabel("K tokens/s")
            ax.set_title(f"{tokens_label(tokens)} tokens x {args.layers} layers")
            ax.legend()
        save_figure(fig, png)

    write_outputs(args.out, "codecs", data, plot if speeds else None)


if __name__ == "__main__":
    main()
