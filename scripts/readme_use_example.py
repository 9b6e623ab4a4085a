"""The README's "Use" example, run end to end with small real tensors (scripts/check_package.sh
runs it in a fresh venv against the built wheel).

    python scripts/readme_use_example.py ROOT [DATABASE_URL]

ROOT must not exist yet. The code below is the README's snippet, with the names it leaves to the
reader (tokens, layers, longer_tokens, longer_layers) filled in and a small MLA layout in place of
DeepSeek-V3's 61 layers; it uses only the public API the README shows, and asserts what the
README's comments promise, down to the loaded bytes. Exits non-zero if any check fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import tenantkv

NUM_LAYERS, KV_LORA_RANK, ROPE_DIM = 3, 32, 16


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[1])
    if root.exists():
        print(f"{root} exists; give a new directory", file=sys.stderr)
        return 2
    open_options = {"database_url": argv[2]} if len(argv) == 3 else {}

    generator = torch.Generator().manual_seed(0)
    width = KV_LORA_RANK + ROPE_DIM
    tokens = list(range(1000, 1000 + 2 * tenantkv.BLOCK_TOKENS))  # two full blocks
    layers = [
        torch.randn(len(tokens), width, generator=generator).to(torch.bfloat16)
        for _ in range(NUM_LAYERS)
    ]
    # a later turn: one more block after the first two
    longer_tokens = [*tokens, *range(5000, 5000 + tenantkv.BLOCK_TOKENS)]
    longer_layers = [
        torch.cat(
            [layer, torch.randn(tenantkv.BLOCK_TOKENS, width, generator=generator).to(layer.dtype)]
        )
        for layer in layers
    ]

    # --- the README's snippet ---
    with tenantkv.open(root, **open_options) as kv:
        kv.create_tenant("acme")
        try:
            kv.create_tenant("acme")
        except tenantkv.TenantExistsError:
            pass
        else:
            raise AssertionError("a duplicate tenant name did not raise TenantExistsError")
        layout = tenantkv.KVLayout.mla(
            num_layers=NUM_LAYERS,
            kv_lora_rank=KV_LORA_RANK,
            rope_dim=ROPE_DIM,
            dtype=torch.bfloat16,
        )
        ns = kv.namespace("acme", model="deepseek-v3", layout=layout, scope=None)
        stored = ns.store(tokens, layers)
        assert stored == len(tokens), f"store: {stored} tokens newly stored, not {len(tokens)}"
        n = ns.lookup(tokens)
        assert n == len(tokens), f"lookup: {n}, not {len(tokens)}"
        start = ns.cached_length(longer_tokens)
        assert start == len(tokens), f"cached_length: {start}, not {len(tokens)}"
        stored = ns.store(longer_tokens, [layer[start:] for layer in longer_layers], start=start)
        assert stored == tenantkv.BLOCK_TOKENS, f"store of the later turn: {stored}"
        with ns.load(tokens[:n], device="cpu") as stream:
            seen = []
            for layer_index, layer in stream:
                seen.append(layer_index)
                assert layer.shape == (n, width), f"layer {layer_index}: shape {tuple(layer.shape)}"
                assert layer.dtype == torch.bfloat16, f"layer {layer_index}: dtype {layer.dtype}"
                assert _bytes(layer) == _bytes(layers[layer_index][:n]), (
                    f"layer {layer_index}: loaded bytes differ from the stored ones"
                )
            assert seen == list(range(NUM_LAYERS)), f"layers arrived as {seen}"
        # --- end of the snippet; the later turn's prefix loads back too ---
        m = ns.lookup(longer_tokens)
        assert m == len(longer_tokens), f"lookup of the later turn: {m}"
        with ns.load(longer_tokens[:m], device="cpu") as stream:
            for layer_index, layer in stream:
                assert _bytes(layer) == _bytes(longer_layers[layer_index][:m]), (
                    f"later turn, layer {layer_index}: loaded bytes differ from the stored ones"
                )

    where = "the default SQLite index" if not open_options else "the given database_url"
    print(
        f"README Use example: {NUM_LAYERS}-layer MLA layout on {where}: stored {len(tokens)} + "
        f"{tenantkv.BLOCK_TOKENS} tokens, looked up, loaded back byte for byte "
        f"(tenantkv {tenantkv.__version__} from {Path(tenantkv.__file__).parent})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
