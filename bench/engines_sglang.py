#!/usr/bin/env python3
"""SGLang HiCache backend: batches of pages stored as one extent and loaded in one plan, against
page by page.

The backend (``tenantkv.integrations.sglang``) stores what HiCache hands it in one call
(``batch_set_v1``: pages from host-pool indices) as one extent (``Namespace.store_pages``: one
sealing pass, one file, one index transaction); page by page (``set`` for each page, what the
backend did before) every page is an extent of its own. It loads what HiCache asks for in one
call (``batch_get_v1``) as one ``Namespace.load_pages``: the pages of one extent opened once and
read in one pass per layer; page by page (``get`` for each page, then the copy into the host
pool: what ``batch_get_v1`` did before) every page is a lookup and a load of its own.

Both stores are timed on the same pages of a host pool shaped like a DeepSeek-V3 MLA model's
(``--page-tokens`` tokens per page, 61 layers, 576 bf16 values per token and layer: 4.5 MB per
64-token page), fresh page hashes each round, in alternating order; then the batch stored as one
extent is loaded into another pool both ways, again in alternating order, and every loaded byte
is checked against the stored pages (``--codec none``), or against the other way's bytes and a
bound on the relative error (a lossy codec: both ways decode the same codes).

Reported: min / median / max ms per batch of (store, load) x (batched, per page), and the
ratio per page / batched of the medians (same run). A signed tenant assertion is verified as in
a deployment; a SQLite index; extents through the page cache (``durable=False``).

``--errors`` instead measures what the lossy codecs do to an MLA page's parts (relative L2
error of ``c_KV`` and ``k_rot`` over 8 pages, Gaussian and with eight outlier channels x 40 in
``c_KV``), through the backend (``batch_set_v1`` then ``batch_get_v1``): fp8 (one scale per
page), int4 as the backend codes it (``c_KV`` int4, ``k_rot`` fp8), and, for comparison, the
plain alternative of int4 over contiguous groups of 32 values of each 576-value row, which codes
``k_rot`` in int4 too (the codec's own 4-bit part, not a backend option).

Run (in the engine venv, scripts/setup_engines.sh):
    .venv-engines/bin/python bench/engines_sglang.py [--batches 4,16,32] [--reps 3]
        [--codec none|fp8|int4] [--out DIR]
    .venv-engines/bin/python bench/engines_sglang.py --errors
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS, CELL = 61, 576


class MLAHostPool:
    """SGLang's host-pool page API over a page-first buffer ``[tokens, layers, cell]``, with the
    MLA host pool's size attributes (what int4 reads)."""

    kv_lora_rank, qk_rope_head_dim = 512, 64

    def __init__(self, pages: int, page_tokens: int) -> None:
        self.page_size = page_tokens
        self.dtype = torch.bfloat16
        self.kv_buffer = torch.zeros(pages * page_tokens, LAYERS, CELL, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * LAYERS * CELL, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[index : index + self.page_size] = data_page.reshape(
            self.page_size, LAYERS, CELL
        )


def backend(root: Path, pem: str, assertion: str, host: MLAHostPool, codec: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from tenantkv.integrations.sglang import TenantKVHiCacheStorage

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench-mla",
        extra_config={
            "root": str(root),
            "open_options": {"durable": False},
            "gateway_public_keys": [pem],
            "tenantkv_assertion": assertion,
            "max_assertion_lifetime": 3600,
            "codec": codec,
        },
    )
    storage = TenantKVHiCacheStorage(config)
    storage.register_mem_pool_host(host)
    return storage


def main() -> None:
    from _cli import bench_parser, int_list, write_outputs
    from _common import format_stats_table, print_machine
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    import tenantkv
    from tenantkv.tenant_assertion import AssertionSigner, public_key_pem

    parser = bench_parser(__doc__, reps=3)
    parser.add_argument("--batches", type=int_list, default="4,16,32")
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--codec", choices=("none", "fp8", "int4"), default="none")
    parser.add_argument("--errors", action="store_true", help="codec error of MLA pages")
    args = parser.parse_args()
    if args.errors:
        errors(args.page_tokens, args.dir)
        return
    biggest = max(args.batches)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-sglang-bench-", dir=args.dir) as tmp:
        print_machine(tmp, codec=args.codec)
        root = Path(tmp) / "cache"
        with tenantkv.open(root, durable=False) as kv:
            kv.create_tenant("bench", quota_bytes=64 << 30)
        signer = AssertionSigner(Ed25519PrivateKey.generate())
        pem = public_key_pem(signer.public_key).decode("ascii")
        source = MLAHostPool(biggest, args.page_tokens)
        source.kv_buffer.copy_(torch.randn(source.kv_buffer.shape).to(torch.bfloat16))
        if args.codec == "none":  # every bit pattern, NaNs included: codec none moves bytes
            source.kv_buffer.view(torch.int16).copy_(
                torch.randint(-(1 << 15), 1 << 15, source.kv_buffer.shape, dtype=torch.int16)
            )
        target = MLAHostPool(biggest, args.page_tokens)
        storage = backend(root, pem, signer.sign("bench", ttl=3600), source, args.codec)
        page_bytes = args.page_tokens * LAYERS * CELL * 2
        print(f"page: {args.page_tokens} tokens x {LAYERS} layers x {CELL} bf16 = {page_bytes} B")
        storage.batch_set_v1(["warm-up"], torch.arange(0, args.page_tokens))
        for pages in args.batches:
            indices = torch.arange(0, pages * args.page_tokens)
            span = slice(0, pages * args.page_tokens)
            for rep in range(args.reps):
                order = ("batched", "per page") if rep % 2 == 0 else ("per page", "batched")
                stored_keys: dict[str, list[str]] = {}
                for how in order:
                    keys = [f"{how}-{pages}-{rep}-{i}" for i in range(pages)]
                    started = time.perf_counter()
                    if how == "batched":
                        done = storage.batch_set_v1(keys, indices)
                    else:
                        done = [
                            storage.set(k, source.get_data_page(i * args.page_tokens))
                            for i, k in enumerate(keys)
                        ]
                    results.setdefault(f"{pages} pages store {how}", []).append(
                        time.perf_counter() - started
                    )
                    assert all(done), f"{how}: a page was not stored"
                    stored_keys[how] = keys
                keys = stored_keys["batched"]  # the batch's one extent, loaded both ways
                storage.mem_pool_host = target
                loaded: dict[str, torch.Tensor] = {}
                for how in order:
                    target.kv_buffer.zero_()
                    started = time.perf_counter()
                    if how == "batched":
                        got = storage.batch_get_v1(keys, indices)
                    else:  # what batch_get_v1 did before: a lookup and a load per page
                        got = []
                        for i, key in enumerate(keys):
                            page = storage.get(key)
                            if page is not None:
                                target.set_from_flat_data_page(i * args.page_tokens, page)
                            got.append(page is not None)
                    results.setdefault(f"{pages} pages load {how}", []).append(
                        time.perf_counter() - started
                    )
                    assert all(got), f"load {how}: a page missed"
                    loaded[how] = target.kv_buffer[span].clone()
                storage.mem_pool_host = source
                check(loaded, source.kv_buffer[span], args.codec)
    rows = [(name, [v * 1000 for v in values], "") for name, values in results.items()]
    print()
    print(format_stats_table(rows, "ms", label="batch  op  how", digits=1))
    print()
    print("ratios of medians, per page / batched (same run):")
    for pages in args.batches:
        line = []
        for op in ("store", "load"):
            per_page = statistics.median(results[f"{pages} pages {op} per page"])
            batched = statistics.median(results[f"{pages} pages {op} batched"])
            rate = pages * page_bytes / batched / 1e9
            line.append(f"{op} {per_page / batched:.2f} (batched {rate:.2f} GB/s)")
        print(f"  {pages:>3} pages: " + "  ".join(line))
    write_outputs(args.out, "engines_sglang", results, lambda png: plot(results, args.batches, png))


def errors(page_tokens: int, data_dir: str | None) -> None:
    """Relative error of ``c_KV`` and ``k_rot`` through the backend, per codec and source."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    import tenantkv
    from tenantkv.codecs import Component, _Int4Part
    from tenantkv.integrations.engine_cache import close_caches
    from tenantkv.tenant_assertion import AssertionSigner, public_key_pem

    pages, rank = 8, MLAHostPool.kv_lora_rank
    indices = torch.arange(0, pages * page_tokens)

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want.float()).norm() / want.float().norm())

    print(f"relative L2 error, {pages} pages of {page_tokens} tokens x {LAYERS} x {CELL} bf16")
    print(f"{'source':<14} {'codec':<28} {'c_KV':>7} {'k_rot':>7}")
    for source_name in ("gaussian", "heavy-tailed"):
        generator = torch.Generator().manual_seed(7)
        source = MLAHostPool(pages, page_tokens)
        values = torch.randn(source.kv_buffer.shape, generator=generator)
        if source_name == "heavy-tailed":
            values[..., :8] *= 40.0
        source.kv_buffer.copy_(values.to(torch.bfloat16))
        want = source.kv_buffer
        for codec in ("fp8", "int4"):
            with tempfile.TemporaryDirectory(prefix="tkv-sglang-err-", dir=data_dir) as tmp:
                root = Path(tmp) / "cache"
                with tenantkv.open(root, durable=False) as kv:
                    kv.create_tenant("bench", quota_bytes=64 << 30)
                signer = AssertionSigner(Ed25519PrivateKey.generate())
                pem = public_key_pem(signer.public_key).decode("ascii")
                storage = backend(root, pem, signer.sign("bench", ttl=3600), source, codec)
                keys = [f"page-{i}" for i in range(pages)]
                assert all(storage.batch_set_v1(keys, indices))
                target = MLAHostPool(pages, page_tokens)
                storage.mem_pool_host = target
                assert all(storage.batch_get_v1(keys, indices))
                got = target.kv_buffer
                close_caches()  # the backend's cache of this root, before it is removed
            label = "fp8 (page scale)" if codec == "fp8" else "int4 (c_KV int4, k_rot fp8)"
            latent = error(got[..., :rank], want[..., :rank])
            rope = error(got[..., rank:], want[..., rank:])
            print(f"{source_name:<14} {label:<28} {latent:7.4f} {rope:7.4f}")
        # the alternative: contiguous groups of 32 of each 576-value row, k_rot in int4 too
        rows = want.float().reshape(-1, 1, CELL)
        part = _Int4Part(Component("row", 0, CELL, CELL, positional=False), 1)
        back = part.decode(part.encode(rows)).reshape(want.shape)
        latent = error(back[..., :rank], want[..., :rank])
        rope = error(back[..., rank:], want[..., rank:])
        print(f"{source_name:<14} {'int4, groups of 32 per row':<28} {latent:7.4f} {rope:7.4f}")


def check(loaded: dict[str, torch.Tensor], stored: torch.Tensor, codec: str) -> None:
    """Every loaded byte: equal to the stored ones under codec ``none``; under a lossy codec,
    both ways equal to each other (the same codes decoded) and close to the stored values."""
    batched, per_page = loaded["batched"], loaded["per page"]
    if codec == "none":
        assert torch.equal(batched.view(torch.int16), stored.view(torch.int16)), "batched"
        assert torch.equal(per_page.view(torch.int16), stored.view(torch.int16)), "per page"
        return
    assert torch.equal(batched.view(torch.int16), per_page.view(torch.int16)), "ways differ"
    error = float((batched.float() - stored.float()).norm() / stored.float().norm())
    assert error < 0.15, f"relative error {error:.3f}"


def plot(results: dict[str, list[float]], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op, style in (("store", "-"), ("load", "--")):
        for how in ("batched", "per page"):
            medians = [statistics.median(results[f"{n} pages {op} {how}"]) * 1000 for n in batches]
            ax.plot(batches, medians, style, marker="o", label=f"{op}, {how}")
    ax.set_xlabel("pages per HiCache call")
    ax.set_ylabel("ms per call (median)")
    ax.set_title("tenantkv SGLang backend: batches (one extent, one plan) vs per page")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
