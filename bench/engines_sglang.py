#!/usr/bin/env python3
"""SGLang HiCache backend: a batch of pages stored as one extent against one extent per page.

The backend (``tenantkv.integrations.sglang``) stores what HiCache hands it in one call
(``batch_set_v1``: pages from host-pool indices) as one extent (``Namespace.store_pages``: one
sealing pass, one file, one index transaction); page by page (``set`` for each page, what the
backend did before) every page is an extent of its own. Both are timed on the same pages of a
host pool shaped like a DeepSeek-V3 MLA model's (``--page-tokens`` tokens per page, 61 layers,
576 bf16 values per token and layer: 4.5 MB per 64-token page), fresh page hashes each round,
in alternating order, then each batch is read back with ``batch_get_v1`` into another pool and
every byte is checked.

Reported: min / median / max ms per batch of (store, load) x (batched, per page), and the
ratio per page / batched of the medians (same run). A signed tenant assertion is verified as in
a deployment; a SQLite index; extents through the page cache (``durable=False``).

Run (in the engine venv, scripts/setup_engines.sh):
    .venv-engines/bin/python bench/engines_sglang.py [--batches 4,16,32] [--reps 3] [--out DIR]
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
    """SGLang's host-pool page API over a page-first buffer ``[tokens, layers, cell]``."""

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


def backend(root: Path, pem: str, assertion: str, host: MLAHostPool) -> Any:
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
    args = parser.parse_args()
    biggest = max(args.batches)
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tkv-sglang-bench-", dir=args.dir) as tmp:
        print_machine(tmp)
        root = Path(tmp) / "cache"
        with tenantkv.open(root, durable=False) as kv:
            kv.create_tenant("bench", quota_bytes=64 << 30)
        signer = AssertionSigner(Ed25519PrivateKey.generate())
        pem = public_key_pem(signer.public_key).decode("ascii")
        source = MLAHostPool(biggest, args.page_tokens)
        source.kv_buffer.view(torch.int16).copy_(
            torch.randint(-(1 << 15), 1 << 15, source.kv_buffer.shape, dtype=torch.int16)
        )
        target = MLAHostPool(biggest, args.page_tokens)
        storage = backend(root, pem, signer.sign("bench", ttl=3600), source)
        page_bytes = args.page_tokens * LAYERS * CELL * 2
        print(f"page: {args.page_tokens} tokens x {LAYERS} layers x {CELL} bf16 = {page_bytes} B")
        storage.batch_set_v1(["warm-up"], torch.arange(0, args.page_tokens))
        for pages in args.batches:
            indices = torch.arange(0, pages * args.page_tokens)
            for rep in range(args.reps):
                order = ("batched", "per page") if rep % 2 == 0 else ("per page", "batched")
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
                    stored = time.perf_counter() - started
                    assert all(done), f"{how}: a page was not stored"
                    target.kv_buffer.zero_()
                    storage.mem_pool_host = target
                    started = time.perf_counter()
                    got = storage.batch_get_v1(keys, indices)
                    loaded = time.perf_counter() - started
                    storage.mem_pool_host = source
                    assert all(got), f"{how}: a page missed"
                    span = slice(0, pages * args.page_tokens)
                    same = torch.equal(
                        target.kv_buffer[span].view(torch.int16),
                        source.kv_buffer[span].view(torch.int16),
                    )
                    assert same, f"{how}: loaded bytes differ"
                    for op, value in (("store", stored), ("load", loaded)):
                        results.setdefault(f"{pages} pages {op} {how}", []).append(value)
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
    ax.set_title("tenantkv SGLang backend: one extent per batch vs per page")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
