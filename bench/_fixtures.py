"""What the benchmarks run on: the DeepSeek-V3-shaped MLA prefix (its layout, random tokens and
layers), caches opened with a tenant and a namespace, a PostgreSQL schema of a run's own, loads
through tenantkv (timed, checked, or just drained) and a small random Llama.

tenantkv is imported where it is used, so that a script measuring only its baselines (and the
peer benchmark's venv) can import this module without it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import random
import secrets
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from types import ModuleType
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# DeepSeek-V3's MLA latent: kv_lora_rank 512 + rope 64 = 576 bf16 values (1,152 B) per token
# and layer, 61 layers; its vocabulary.
KV_LORA_RANK = 512
ROPE_DIM = 64
VALUES_PER_TOKEN = KV_LORA_RANK + ROPE_DIM
DTYPE = torch.bfloat16
LAYERS = 61
VOCAB_SIZE = 129_280
BLOCK_TOKENS = 64

DEFAULT_POSTGRES = os.environ.get(
    "TENANTKV_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def import_tenantkv(hint: str = "") -> ModuleType:
    """Import tenantkv (installed, else from the repository root) or exit with a clear message."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    try:
        tenantkv = importlib.import_module("tenantkv")
    except Exception as exc:
        reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        sys.exit(
            f"error: cannot import tenantkv ({reason}).\n"
            f"Install it or run from the repository ({REPO_ROOT}). {hint}".rstrip()
        )
    missing = [name for name in ("open", "KVLayout") if not hasattr(tenantkv, name)]
    if missing:
        where = getattr(tenantkv, "__file__", None) or list(getattr(tenantkv, "__path__", []))
        sys.exit(
            f"error: tenantkv (from {where}) has no {', '.join(missing)}; is it finished? {hint}"
        )
    return tenantkv


# --------------------------------------------------------------------------- #
# Layouts, tokens and layers
# --------------------------------------------------------------------------- #


def deepseek_layout(layers: int = LAYERS) -> Any:
    """DeepSeek-V3's MLA layout (576 bf16 values per token and layer) with ``layers`` layers."""
    import tenantkv

    return tenantkv.KVLayout.mla(
        num_layers=layers, kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, dtype=DTYPE
    )


def lookup_layout() -> Any:
    """One small MLA layer: a lookup reads only the index, so the KV's size does not matter."""
    import tenantkv

    return tenantkv.KVLayout.mla(num_layers=1, kv_lora_rank=32, rope_dim=8, dtype=DTYPE)


def random_tokens(rng: random.Random, count: int, vocab: int = VOCAB_SIZE) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def prefix_tokens(seed: int, tokens: int) -> list[int]:
    """The prefix of one size; a child process regenerates it from the same seed."""
    return random_tokens(random.Random(seed * 1_000_003 + tokens), tokens)


def torch_tokens(count: int, generator: torch.Generator | int) -> list[int]:
    """``count`` token ids below 50,000 from torch's generator (or one seeded with it)."""
    if not isinstance(generator, torch.Generator):
        generator = torch.Generator().manual_seed(generator)
    return torch.randint(0, 50_000, (count,), generator=generator).tolist()


def random_layers(layout: Any, tokens: int, generator: torch.Generator | int) -> list[Any]:
    """One random layer per layer of ``layout``: ``[tokens, values]`` for MLA, else ``(k, v)``
    of ``[tokens, heads, head_dim]``; from ``generator`` (or one seeded with it)."""
    if not isinstance(generator, torch.Generator):
        generator = torch.Generator().manual_seed(generator)
    layers: list[Any] = []
    for _ in range(layout.num_layers):
        if layout.kind == "mla":
            shape: tuple[int, ...] = (tokens, layout.values_per_token)
            layers.append(torch.randn(*shape, generator=generator).to(layout.dtype))
        else:
            shape = (tokens, layout.num_kv_heads, layout.head_dim)
            k = torch.randn(*shape, generator=generator).to(layout.dtype)
            v = torch.randn(*shape, generator=generator).to(layout.dtype)
            layers.append((k, v))
    return layers


def vllm_style_chain(
    tokens: Sequence[int], block: int, parent: bytes = b"\0" * 32, protocol: int | None = None
) -> list[bytes]:
    """vLLM's chained prefix-block hash (``hash_block_tokens`` with ``sha256``): per whole
    block, sha256 over the pickle of (parent hash, the block's token ids, no extra keys)."""
    keys = []
    for start in range(0, len(tokens) // block * block, block):
        data = pickle.dumps((parent, tuple(tokens[start : start + block]), None), protocol)
        parent = hashlib.sha256(data).digest()
        keys.append(parent)
    return keys


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, on the calling thread (numpy), not with ``torch.equal``: that runs on
    torch's OpenMP pool, whose threads spin for a few ms after it returns and, on a machine of
    two cores, take one from the next system's timed load (8K, tenantkv ``out=``, medians of
    12 alternating loads right after a ``torch.equal`` of every layer: layer 0 took 5.1 ms,
    against 1.9-2.4 back to back, 2.2 when 20 ms passed after the check, and 2.6 with
    ``OMP_WAIT_POLICY=PASSIVE``)."""
    return tuple(a.shape) == tuple(b.shape) and bool(
        np.array_equal(a.view(torch.int16).numpy(), b.view(torch.int16).numpy())
    )


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def next_layer_counted_from_consumption(schedule: Any) -> int:
    """``Schedule.next_layer`` as it was while a load's read-ahead window counted from the
    layers its caller consumed alone, before it followed the layer the caller waits for: put
    back (assigned to ``Schedule.next_layer``) as the same-run baseline of
    ``bench/layer_hooks.py`` and the vLLM benchmarks' ``tenantkv-window-from-consumed``."""
    item = schedule.next_item
    if item >= schedule.total or schedule.stopped:
        return -1
    first = schedule.first_chunks
    layer = 0 if item < first else 1 + (item - first) // schedule.chunks
    if layer > schedule.demanded and (
        schedule.broken or layer >= schedule.released + schedule.window
    ):
        return -1
    return int(layer)


# --------------------------------------------------------------------------- #
# Caches and indexes
# --------------------------------------------------------------------------- #


def open_cache(root: Path | str, database_url: str | None = None, **options: Any) -> Any:
    """``tenantkv.open(root, **options)``, its index on ``database_url`` when one is given."""
    import tenantkv

    if database_url is not None:
        options["database_url"] = database_url
    return tenantkv.open(root, **options)


def tenant_namespace(
    kv: Any,
    tenant: str,
    layout: Any,
    *,
    model: str = "deepseek-v3",
    quota_bytes: int | None = None,
    **options: Any,
) -> Any:
    """Create ``tenant`` in ``kv`` (with ``quota_bytes`` if given) and open its namespace."""
    kv.create_tenant(tenant, **({} if quota_bytes is None else {"quota_bytes": quota_bytes}))
    return kv.namespace(tenant, model=model, layout=layout, **options)


class PostgresSchema:
    """A schema of its own on the server, for one run; dropped by :meth:`drop`."""

    def __init__(self, base_url: str) -> None:
        from sqlalchemy import create_engine

        self.base_url = base_url
        self.name = f"tkv_bench_{secrets.token_hex(4)}"
        self._engine = create_engine(base_url, pool_size=1, max_overflow=0)
        with self._engine.begin() as connection:
            connection.exec_driver_sql(f"CREATE SCHEMA {self.name}")

    @property
    def url(self) -> str:
        sep = "&" if "?" in self.base_url else "?"
        return f"{self.base_url}{sep}options=-csearch_path%3D{self.name}"

    def drop(self) -> None:
        with self._engine.begin() as connection:
            connection.exec_driver_sql(f"DROP SCHEMA IF EXISTS {self.name} CASCADE")
        self._engine.dispose()


@contextmanager
def postgres_schema(base_url: str) -> Iterator[str]:
    """The URL of a fresh schema on ``base_url``, dropped on the way out."""
    schema = PostgresSchema(base_url)
    try:
        yield schema.url
    finally:
        schema.drop()


# --------------------------------------------------------------------------- #
# Loads
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class LoadTimes:
    """Seconds from calling ``ns.load`` to: the stream, the first layer, the last layer, and
    the stream closed; and how many layers it yielded."""

    stream: float
    first: float
    last: float
    total: float
    layers: int


def timed_load(ns: Any, tokens: Sequence[int], **load: Any) -> LoadTimes:
    """One load, every layer received and dropped, timed (see :class:`LoadTimes`)."""
    t0 = perf_counter()
    first = last = 0.0
    received = 0
    with ns.load(tokens, **load) as stream:
        opened = perf_counter()
        for _index, _layer in stream:
            last = perf_counter()
            if received == 0:
                first = last
            received += 1
    return LoadTimes(opened - t0, first - t0, last - t0, perf_counter() - t0, received)


def load_all(ns: Any, tokens: Sequence[int], **load: Any) -> int:
    """One load, every layer received and dropped; the number of layers."""
    received = 0
    with ns.load(tokens, **load) as stream:
        for _ in stream:
            received += 1
    return received


def check_load(
    ns: Any,
    tokens: Sequence[int],
    want: Sequence[torch.Tensor],
    out: list[torch.Tensor] | None = None,
    **load: Any,
) -> None:
    """Untimed: one load whose layers must be the stored bytes, in order, every one of them
    (and, with ``out``, the caller's own tensors)."""
    seen: list[int] = []
    extra = {} if out is None else {"out": out}
    with ns.load(tokens, **load, **extra) as stream:
        for index, layer in stream:
            if not isinstance(layer, torch.Tensor) or layer.dtype != want[index].dtype:
                raise AssertionError(f"layer {index}: got {type(layer).__name__} {layer!r:.60}")
            if not same_bits(layer, want[index]):
                raise AssertionError(f"layer {index}: bytes differ from what was stored")
            if out is not None and (
                layer.data_ptr() != out[index].data_ptr()
                or layer.untyped_storage().data_ptr() != out[index].untyped_storage().data_ptr()
            ):
                raise AssertionError(
                    f"layer {index} is not the caller's buffer (out= was not written in place)"
                )
            seen.append(index)
    if seen != list(range(len(want))):
        raise AssertionError(f"load yielded layers {seen[:8]}... (expected 0..{len(want) - 1})")


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def random_llama(**config: Any) -> Any:
    """A Llama of random weights (torch seeded with 0), vocabulary 4,096; ``config`` gives its
    other ``LlamaConfig`` fields (sizes, heads)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=4096, **config))
