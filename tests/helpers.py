"""Helpers shared by the tests: small layouts, random KV and tokens, comparisons, a clock."""

from __future__ import annotations

from collections.abc import Callable

import torch
from sqlalchemy import select

import tenantkv
from tenantkv import KVLayout
from tenantkv.index.schema import Extent

# Small layouts keep the suite fast; the benchmark covers the DeepSeek-V3 shape.
MLA_SMALL = KVLayout.mla(num_layers=3, kv_lora_rank=32, rope_dim=8, dtype=torch.bfloat16)
MHA_SMALL = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def random_layers(
    layout: KVLayout, num_tokens: int, seed: int = 0
) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Random per-layer KV for ``num_tokens`` tokens in ``layout``'s shape and dtype."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(layout.dtype)

    layers: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(layout.num_layers):
        if layout.kind == "mla":
            layers.append(tensor(num_tokens, layout.values_per_token))
        elif layout.kind == "mha-pages":  # whole pages [P, H, N, 2 * D]
            n = layout.page_tokens
            layers.append(tensor(num_tokens // n, layout.num_kv_heads, n, 2 * layout.head_dim))
        else:
            shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
            layers.append((tensor(*shape), tensor(*shape)))
    return layers


def random_tokens(num_tokens: int, seed: int = 0, vocab: int = 50_000) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_tokens,), generator=generator).tolist()


def load_all(ns: tenantkv.Namespace, tokens: list[int]) -> list[tenantkv.Layer]:
    """Load a cached prefix and return its layers in order (checks the order too)."""
    out: list[tenantkv.Layer] = []
    with ns.load(tokens) as stream:
        for index, layer in stream:
            assert index == len(out), f"layer {index} arrived after {len(out)} layers"
            out.append(layer)
    return out


def store_and_load_checked(kv: tenantkv.TenantKV, seed: int = 3) -> None:
    """Create tenant ``acme``, store a 256-token MLA prefix and load it back, checked: the
    cache's pools have then run a store and a load (their threads started)."""
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="m", layout=MLA_SMALL)
    tokens = random_tokens(256, seed=seed)
    layers = random_layers(MLA_SMALL, 256, seed=seed)
    ns.store(tokens, layers)
    got = load_all(ns, tokens)
    assert all(layers_equal(a, b) for a, b in zip(got, layers, strict=True))


def layers_equal(a: tenantkv.Layer, b: tenantkv.Layer) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    assert isinstance(a, tuple) and isinstance(b, tuple)
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def prefix_of(layer: tenantkv.Layer, num_tokens: int) -> tenantkv.Layer:
    if isinstance(layer, torch.Tensor):
        return layer[:num_tokens]
    return layer[0][:num_tokens], layer[1][:num_tokens]


class ManualClock:
    """A clock the test moves by hand, for code that takes one: ``clock.now = t`` sets it
    (backwards too), ``clock.advance(seconds)`` moves it forward."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (> 0); return the new time."""
        assert seconds > 0, "advance() only moves the clock forward"
        self.now += seconds
        return self.now


def held_background(kv: tenantkv.TenantKV) -> list[Callable[[], object]]:
    """Keep what ``kv`` hands to its bookkeeping thread (a batch of loads' records of use), for
    the test to run when it chooses, on its own thread, or never."""
    tasks: list[Callable[[], object]] = []

    def submit(task: Callable[..., object], *args: object) -> None:
        tasks.append(lambda: task(*args))

    kv.context.runtime.submit_background = submit  # type: ignore[method-assign]
    return tasks


def last_used(kv: tenantkv.TenantKV) -> dict[str, float]:
    """Every extent's ``last_used_at`` in the index, by extent id."""
    with kv.context.index.read() as session:
        return dict(session.execute(select(Extent.id, Extent.last_used_at)).all())
