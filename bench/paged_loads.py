"""A hit's load into vLLM's CPU pages, A/B in one process: MHA layers stored as token rows
(``KVLayout.mha``: each layer decrypted into a tensor, then copied into the pages head by head,
as the vLLM connector did) against layers stored as the pages hold them (``KVLayout.mha_pages``:
decrypted straight into the pages, what the connector does now).

The layout is ``bench/engines_vllm.py``'s model (8 layers, 4 KV heads of 64, fp32, 32-token
pages), so a 2,016-token load moves 32 MB. The request's pages are scattered over the engine's
pages as vLLM hands them out (runs of consecutive pages). Rows: ms per load, min / median / max
over ``--reps`` loads of each, alternating which goes first; the ratio of medians, same run.
Every loaded page is compared with its source after the timed loads.

    .venv/bin/python bench/paged_loads.py [--tokens 2016] [--reps 60]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from _cli import bench_parser, write_outputs
from _common import format_ratios, format_stats_table, print_machine
from _fixtures import import_tenantkv, prefix_tokens, tenant_namespace
from _plots import horizontal_bars

tenantkv = import_tenantkv()
from tenantkv.integrations.paged_kv import PagedLayer, RequestBlocks  # noqa: E402

KV_HEADS, HEAD_DIM, PAGE = 4, 64, 32  # bench/engines_vllm.py's model and block size
DTYPE = torch.float32
ROWS, PAGES = "token rows, then copied into the pages", "stored as the pages"


def main() -> None:
    parser = bench_parser(__doc__, reps=60, layers=8)
    parser.add_argument("--tokens", type=int, default=2016, help="a multiple of 32 (2016)")
    args = parser.parse_args()
    if args.tokens % PAGE:
        parser.error(f"--tokens must be a multiple of {PAGE}")
    print_machine(args.dir)
    count = args.tokens // PAGE
    # vLLM's free pages, handed out in runs: the request's pages in 4 descending runs, a gap of
    # two pages between runs (other requests' pages)
    per = -(-count // 4)
    block_ids = [p for r in range(4) for p in range(r * (per + 2) + per - 1, r * (per + 2) - 1, -1)]
    block_ids = block_ids[:count]
    engine_pages = 4 * (per + 2)
    blocks = RequestBlocks(block_ids)
    generator = torch.Generator().manual_seed(0)
    source = [
        torch.randn(engine_pages, KV_HEADS, PAGE, 2 * HEAD_DIM, generator=generator).to(DTYPE)
        for _ in range(args.layers)
    ]
    layouts = {
        ROWS: tenantkv.KVLayout.mha(args.layers, KV_HEADS, HEAD_DIM, DTYPE),
        PAGES: tenantkv.KVLayout.mha_pages(args.layers, KV_HEADS, HEAD_DIM, PAGE, DTYPE),
    }
    tokens = prefix_tokens(0, args.tokens)
    total = args.tokens * args.layers * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    kv = tenantkv.open(Path(tempfile.mkdtemp(prefix="paged-loads-", dir=args.dir)) / "cache")
    try:
        targets, namespaces = {}, {}
        for name, layout in layouts.items():
            ns = tenant_namespace(
                kv,
                "rows" if layout.kind == "mha" else "pages",
                layout,
                model="bench-llama",
                quota_bytes=4 * total + (1 << 30),
                block_tokens=PAGE,
            )
            stored = [PagedLayer(pages, layout).read(blocks) for pages in source]
            if ns.store(tokens, stored) != args.tokens:
                raise RuntimeError("the prefix was not stored whole")
            namespaces[name] = ns
            targets[name] = [PagedLayer(torch.zeros_like(pages), layout) for pages in source]

        def load_rows() -> None:
            paged = targets[ROWS]
            with namespaces[ROWS].load(tokens) as stream:
                for index, layer in stream:
                    paged[index].write(blocks, layer)

        def load_pages() -> None:
            rows = [paged.rows for paged in targets[PAGES]]
            out = namespaces[PAGES].load(
                tokens, "cpu", out=rows, block_rows=blocks.first_rows(PAGE)
            )
            with out as stream:
                for _ in stream:
                    pass

        loads = {ROWS: load_rows, PAGES: load_pages}
        for load in loads.values():
            load()
        times: dict[str, list[float]] = {name: [] for name in loads}
        for rep in range(args.reps):
            for name in loads if rep % 2 == 0 else reversed(list(loads)):
                started = time.perf_counter()
                loads[name]()
                times[name].append((time.perf_counter() - started) * 1000)
        for name, paged in targets.items():
            for layer, pages in zip(paged, source, strict=True):
                if not torch.equal(layer.pages[block_ids], pages[block_ids]):
                    raise AssertionError(f"{name}: a loaded page differs from its source")
    finally:
        kv.close()

    title = f"{args.tokens:,}-token loads into vLLM-shaped CPU pages ({total / 1e6:.0f} MB), ms"
    print(title)
    print(format_stats_table([(n, v, "") for n, v in times.items()], "ms", label="stored as"))
    ratio = statistics.median(times[PAGES]) / statistics.median(times[ROWS])
    ratios = [(f"{PAGES} / {ROWS}", ratio, "")]
    print("\nratios of medians (same run):")
    print(format_ratios(ratios))

    def plot(path: Path) -> None:
        horizontal_bars(path, times, "ms (min / median / max)", title)

    write_outputs(args.out, "paged_loads", {"ms": times, "ratios": ratios}, plot)


if __name__ == "__main__":
    main()
