"""At rest, nothing a tenant gave us is readable: no KV bytes, no token ids, no key material.

A prefix is stored whose KV memory holds recognisable canary byte patterns and whose token ids are
a distinctive sequence; then every file under the cache root (extents, SQLite index with its WAL
and shared-memory files, key file, temporary files) is scanned for those bytes. On PostgreSQL,
whose files are the server's, every value of every row of the cache's schema is scanned instead.
The scanner is checked against a file holding exactly the plaintext, and the cache must load the
exact data back, so the scan cannot pass by looking at nothing or by the cache storing nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

import tenantkv
from tenantkv import KVLayout, TenantKV
from tests.indexes import Index

from .helpers import MHA_SMALL, MLA_SMALL, load_all

NUM_TOKENS = 3 * 64  # three full blocks
WINDOW = 8  # consecutive token ids per searched needle
CHUNK = 16  # bytes of a canary pattern per searched needle

# A distinctive token sequence (not 0, 1, 2, ...: those small values are everywhere in a DB file).
TOKENS = [40_000 + 37 * i for i in range(NUM_TOKENS)]


def _pattern(tag: str) -> bytes:
    pattern = f"CANARY-{tag}-0123456789".encode("ascii")
    assert len(pattern) >= CHUNK + 4
    return pattern


def _canary_tensor(pattern: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose memory is ``pattern`` repeated (ASCII bytes: never a NaN in fp16/bf16)."""
    size = int(np.prod(shape)) * dtype.itemsize
    raw = bytearray((pattern * (size // len(pattern) + 1))[:size])
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def canary_layers(
    layout: KVLayout, num_tokens: int
) -> tuple[list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]], list[bytes]]:
    """Per-layer KV made of canary patterns, and the patterns used."""
    layers: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
    patterns: list[bytes] = []
    for index in range(layout.num_layers):
        if layout.kind == "mla":
            pattern = _pattern(f"L{index}")
            patterns.append(pattern)
            layers.append(
                _canary_tensor(pattern, (num_tokens, layout.values_per_token), layout.dtype)
            )
        else:
            shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
            k_pattern, v_pattern = _pattern(f"K{index}"), _pattern(f"V{index}")
            patterns += [k_pattern, v_pattern]
            layers.append(
                (
                    _canary_tensor(k_pattern, shape, layout.dtype),
                    _canary_tensor(v_pattern, shape, layout.dtype),
                )
            )
    return layers, patterns


def canary_needles(patterns: Iterable[bytes]) -> set[bytes]:
    """Every CHUNK-byte window of each repeated pattern, whatever its alignment."""
    needles: set[bytes] = set()
    for pattern in patterns:
        doubled = pattern * 2
        needles.update(doubled[start : start + CHUNK] for start in range(len(pattern)))
    return needles


def token_needles(tokens: list[int]) -> dict[str, set[bytes]]:
    """Every window of WINDOW consecutive token ids, in each encoding a leak could take."""
    encodings: dict[str, set[bytes]] = {
        "uint32-le": set(),
        "uint32-be": set(),
        "int64-le": set(),
        "int64-be": set(),
        "decimal-comma": set(),
        "decimal-comma-space": set(),
        "decimal-space": set(),
    }
    for start in range(len(tokens) - WINDOW + 1):
        window = tokens[start : start + WINDOW]
        encodings["uint32-le"].add(np.asarray(window, dtype="<u4").tobytes())
        encodings["uint32-be"].add(np.asarray(window, dtype=">u4").tobytes())
        encodings["int64-le"].add(np.asarray(window, dtype="<i8").tobytes())
        encodings["int64-be"].add(np.asarray(window, dtype=">i8").tobytes())
        encodings["decimal-comma"].add(",".join(map(str, window)).encode())
        encodings["decimal-comma-space"].add(", ".join(map(str, window)).encode())
        encodings["decimal-space"].add(" ".join(map(str, window)).encode())
    return encodings


def scan(files: Iterable[Path], needles: dict[str, set[bytes]]) -> list[tuple[str, str]]:
    """``(file, needle kind)`` for every kind of needle found in every file."""
    found: list[tuple[str, str]] = []
    for path in files:
        data = path.read_bytes()
        for kind, group in needles.items():
            if any(needle in data for needle in group):
                found.append((path.name, kind))
    return found


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def stored_files(root: Path, index: Index) -> list[Path]:
    """Every file under ``root`` and, on PostgreSQL, a file holding every value of every row of
    the index (written beside the root, so it is not in it)."""
    files = all_files(root)
    if not index.is_sqlite:
        rows = index.stored_bytes(index.url(root))
        assert b"acme" in rows  # positive control: the dump holds the tenant's rows
        dump = root.parent / f"{root.name}-index-rows.bin"
        dump.write_bytes(rows)
        files.append(dump)
    return files


def bytes_of(layer: tenantkv.Layer) -> bytes:
    if isinstance(layer, torch.Tensor):
        return layer.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes_of(layer[0]) + bytes_of(layer[1])


def _store_canaries(
    kv: TenantKV, layout: KVLayout
) -> tuple[tenantkv.Namespace, list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]], list[bytes]]:
    kv.create_tenant("acme")
    ns = kv.namespace("acme", model="canary-model", layout=layout)
    layers, patterns = canary_layers(layout, NUM_TOKENS)
    assert ns.store(TOKENS, layers) == NUM_TOKENS
    # Positive control: the cache holds and returns exactly these bytes.
    assert ns.lookup(TOKENS) == NUM_TOKENS
    loaded = load_all(ns, TOKENS)
    assert [bytes_of(x) for x in loaded] == [bytes_of(x) for x in layers]
    return ns, layers, patterns


def test_scanner_finds_plaintext_canaries_and_tokens(tmp_path: Path) -> None:
    """Positive control of the scanner: a file holding the plaintext is flagged for every kind."""
    for layout in (MLA_SMALL, MHA_SMALL):
        layers, patterns = canary_layers(layout, NUM_TOKENS)
        # The bytes as the cache would seal them (k_t || v_t rows for MHA), and as given.
        rows = layout.validate_layers(layers, NUM_TOKENS)
        needles = {"canary": canary_needles(patterns)}
        for index, layer_rows in enumerate(rows):
            path = tmp_path / f"{layout.kind}-rows-{index}.bin"
            path.write_bytes(b"\x00" * 7 + layer_rows.numpy().tobytes()[100:1100])
            assert scan([path], needles) == [(path.name, "canary")]
    tokens = token_needles(TOKENS)
    for kind, group in tokens.items():
        assert len(group) == NUM_TOKENS - WINDOW + 1, kind
    # One file per encoding, each holding just one window of the ids in the middle of noise.
    rng = np.random.default_rng(0)
    window = TOKENS[50 : 50 + WINDOW]
    samples = {
        "uint32-le": np.asarray(window, dtype="<u4").tobytes(),
        "uint32-be": np.asarray(window, dtype=">u4").tobytes(),
        "int64-le": np.asarray(window, dtype="<i8").tobytes(),
        "int64-be": np.asarray(window, dtype=">i8").tobytes(),
        "decimal-comma": ("[" + ",".join(map(str, window)) + "]").encode(),
        "decimal-comma-space": ("[" + ", ".join(map(str, window)) + "]").encode(),
        "decimal-space": (" ".join(map(str, window)) + "\n").encode(),
    }
    for kind, sample in samples.items():
        path = tmp_path / f"tokens-{kind}.bin"
        path.write_bytes(rng.bytes(333) + sample + rng.bytes(333))
        assert (path.name, kind) in scan([path], tokens)
    # And a file of noise is not flagged at all.
    noise = tmp_path / "noise.bin"
    noise.write_bytes(rng.bytes(100_000))
    assert scan([noise], {**tokens, "canary": canary_needles(patterns)}) == []


@pytest.mark.parametrize("layout", [MLA_SMALL, MHA_SMALL], ids=["mla", "mha"])
@pytest.mark.parametrize("closed", [False, True], ids=["open-with-wal", "closed"])
def test_no_kv_bytes_or_token_ids_at_rest(
    kv: TenantKV, cache_root: Path, layout: KVLayout, closed: bool, index: Index
) -> None:
    _ns, _layers, patterns = _store_canaries(kv, layout)
    if closed:
        kv.close()
    elif index.is_sqlite:
        # Open: the latest index writes sit in the WAL; make sure the scan really covers it.
        wal = cache_root / "index.db-wal"
        assert wal.is_file() and wal.stat().st_size > 0
    files = stored_files(cache_root, index)
    names = {p.name for p in files}
    assert ("index.db" in names) == index.is_sqlite
    assert "master.key" in names
    extents = [p for p in files if p.suffix == ".tkx"]
    assert len(extents) == 1
    # The extent holds the whole prefix (so it was scanned with the data in it), sealed.
    assert extents[0].stat().st_size > NUM_TOKENS * layout.token_bytes * layout.num_layers

    needles = {"canary": canary_needles(patterns), **token_needles(TOKENS)}
    assert scan(files, needles) == []


def test_reopened_cache_loads_exact_data_and_files_stay_clean(
    kv: TenantKV, cache_root: Path, index: Index
) -> None:
    """After a close and reopen (WAL checkpointed into the DB) the data is intact and sealed."""
    _ns, layers, patterns = _store_canaries(kv, MLA_SMALL)
    kv.close()
    with tenantkv.open(cache_root, durable=False) as reopened:
        ns = reopened.namespace("acme", model="canary-model", layout=MLA_SMALL)
        assert ns.lookup(TOKENS) == NUM_TOKENS
        loaded = load_all(ns, TOKENS)
        assert [bytes_of(x) for x in loaded] == [bytes_of(x) for x in layers]
        files = stored_files(cache_root, index)
        needles = {"canary": canary_needles(patterns), **token_needles(TOKENS)}
        assert scan(files, needles) == []


def test_key_material_is_private(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, index: Index
) -> None:
    """The key file is 0600, extents are owner-only, and the master key appears nowhere else."""
    monkeypatch.delenv("TENANTKV_MASTER_KEY", raising=False)
    with tenantkv.open(cache_root, durable=False) as kv:
        _store_canaries(kv, MLA_SMALL)
        key_file = cache_root / "master.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        text = key_file.read_text(encoding="ascii").strip()
        raw = bytes.fromhex(text)
        assert len(raw) == 32
        needles = {"key-hex": {text.encode(), text.upper().encode()}, "key-raw": {raw}}
        # Positive control: the scanner finds the key in the key file itself.
        assert scan([key_file], needles) == [("master.key", "key-hex")]
        others = [p for p in stored_files(cache_root, index) if p != key_file]
        assert any(p.name == "index.db" for p in others) == index.is_sqlite
        assert scan(others, needles) == []
        for extent in cache_root.rglob("*.tkx"):
            assert stat.S_IMODE(extent.stat().st_mode) & 0o077 == 0, oct(extent.stat().st_mode)
    # Nothing else in the root leaked a copy of the key (e.g. a leftover temp key file).
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".master.key")]
    assert os.stat(cache_root / "master.key").st_nlink == 1
