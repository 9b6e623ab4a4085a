"""Tests of ``tenantkv.crypto``: master key providers, key wrapping, segment sealing, suites.

Everything runs against the real primitives of ``cryptography``; where a test checks an on-disk
format it re-derives the expected bytes independently from the documented layout.
"""

from __future__ import annotations

import base64
import multiprocessing
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier as ProcessBarrier
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESOCB3
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv.crypto import (
    BLOCK_KEY_BYTES,
    DEFAULT_SUITE,
    ID_BYTES,
    KEY_BYTES,
    MASTER_KEY_ENV,
    SALT_BYTES,
    SEGMENT_FORMAT_VERSION,
    TAG_BYTES,
    CipherSuite,
    CryptoError,
    EnvKeyProvider,
    ExtentCipher,
    KeyEncryptionKey,
    KeyFileProvider,
    KeyWrapper,
    MasterKeyError,
    SealOpenError,
    SegmentContext,
    default_master_key_provider,
    new_key,
    new_salt,
)

SUITES = list(CipherSuite)
GROUP_OR_OTHER = stat.S_IRWXG | stat.S_IRWXO


@pytest.fixture(autouse=True)
def _fixed_umask() -> Iterator[None]:
    """A permissive umask, so file modes reflect what the library asks for, not the umask."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


# ------------------------------------------------------------------------------------------------
# KeyFileProvider
# ------------------------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_file_created_0600_on_first_use_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "master.key"
    assert not path.exists()
    key = KeyFileProvider(path).load()
    assert isinstance(key, bytes) and len(key) == KEY_BYTES
    assert path.is_file()
    assert _mode(path) == 0o600
    # Same key on the next load, through the same and through a fresh provider.
    assert KeyFileProvider(path).load() == key
    assert KeyFileProvider(path, create=False).load() == key
    # No temporary files are left next to the key.
    assert sorted(p.name for p in path.parent.iterdir()) == ["master.key"]


def test_key_files_at_different_paths_hold_different_keys(tmp_path: Path) -> None:
    a = KeyFileProvider(tmp_path / "a.key").load()
    b = KeyFileProvider(tmp_path / "b.key").load()
    assert a != b


def test_key_file_content_is_hex_of_the_key(tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    key = KeyFileProvider(path).load()
    assert bytes.fromhex(path.read_text(encoding="ascii").strip()) == key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o644, 0o666])
def test_key_file_accessible_to_group_or_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "master.key"
    key = KeyFileProvider(path).load()
    os.chmod(path, mode)
    with pytest.raises(MasterKeyError, match="group or others"):
        KeyFileProvider(path).load()
    # The refused file is left alone (not replaced by a fresh key) ...
    os.chmod(path, 0o600)
    # ... and once private again it opens with the same key (positive control).
    assert KeyFileProvider(path).load() == key


def test_key_file_owner_only_modes_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    key = KeyFileProvider(path).load()
    for mode in (0o400, 0o600, 0o700):
        os.chmod(path, mode)
        assert KeyFileProvider(path).load() == key


@pytest.mark.parametrize("content", ["", "\n", "   \n\t\n"])
def test_empty_key_file_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "master.key"
    path.write_text(content, encoding="ascii")
    os.chmod(path, 0o600)
    with pytest.raises(MasterKeyError, match="empty"):
        KeyFileProvider(path).load()
    # An empty file is not silently overwritten with a new key.
    assert path.read_text(encoding="ascii") == content


@pytest.mark.parametrize(
    "content",
    [
        "not a key",
        "ab" * 31,  # 31 bytes of hex
        "ab" * 33,  # 33 bytes of hex
        "zz" * 32,  # 64 characters, not hex (and 48 bytes as base64)
        base64.urlsafe_b64encode(bytes(16)).decode(),  # base64 of the wrong length
        "ab" * 32 + "\n" + "cd" * 32,  # two keys
    ],
)
def test_malformed_key_file_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "master.key"
    path.write_text(content, encoding="ascii")
    os.chmod(path, 0o600)
    with pytest.raises(MasterKeyError):
        KeyFileProvider(path).load()


def test_hand_written_key_file_is_accepted(tmp_path: Path) -> None:
    """Positive control for the malformed cases: hex and base64 keys written by hand open."""
    key = os.urandom(KEY_BYTES)
    for text in (key.hex(), key.hex().upper() + "\n", base64.urlsafe_b64encode(key).decode()):
        path = tmp_path / "master.key"
        path.write_text(text, encoding="ascii")
        os.chmod(path, 0o600)
        assert KeyFileProvider(path, create=False).load() == key


def test_non_ascii_key_file_is_refused_with_master_key_error(tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    path.write_bytes(b"\xff\xfe" * KEY_BYTES)
    os.chmod(path, 0o600)
    with pytest.raises(MasterKeyError):
        KeyFileProvider(path).load()


def test_create_false_without_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    with pytest.raises(MasterKeyError, match="does not exist"):
        KeyFileProvider(path, create=False).load()
    assert not path.exists()
    # Positive control: once created, create=False opens it.
    key = KeyFileProvider(path).load()
    assert KeyFileProvider(path, create=False).load() == key


def _load_key_in_thread(
    path: Path,
    barrier: threading.Barrier,
    lock: threading.Lock,
    results: list[bytes],
    errors: list[BaseException],
) -> None:
    barrier.wait(timeout=30)
    try:
        key = KeyFileProvider(path).load()
    except BaseException as err:
        with lock:
            errors.append(err)
        return
    with lock:
        results.append(key)


def test_threads_racing_on_a_fresh_key_file_agree(tmp_path: Path) -> None:
    threads_per_round = 8
    for round_no in range(10):
        path = tmp_path / f"round{round_no}" / "master.key"
        barrier = threading.Barrier(threads_per_round)
        lock = threading.Lock()
        results: list[bytes] = []
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=_load_key_in_thread, args=(path, barrier, lock, results, errors)
            )
            for _ in range(threads_per_round)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        assert len(results) == threads_per_round
        assert len(set(results)) == 1
        assert KeyFileProvider(path).load() == results[0]
        assert sorted(p.name for p in path.parent.iterdir()) == ["master.key"]


def _load_key_in_child(path: str, barrier: ProcessBarrier, queue: Queue[str]) -> None:
    barrier.wait(timeout=30)
    try:
        queue.put(KeyFileProvider(path).load().hex())
    except BaseException as err:  # report, so the parent fails with a message
        queue.put(f"error: {type(err).__name__}: {err}")


def test_processes_racing_on_a_fresh_key_file_agree(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    processes_per_round = 4
    for round_no in range(3):
        path = tmp_path / f"round{round_no}" / "master.key"
        barrier = ctx.Barrier(processes_per_round)
        queue: Queue[str] = ctx.Queue()
        procs = [
            ctx.Process(target=_load_key_in_child, args=(str(path), barrier, queue))
            for _ in range(processes_per_round)
        ]
        for proc in procs:
            proc.start()
        results = [queue.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0
        assert not [r for r in results if r.startswith("error")], results
        assert len(set(results)) == 1
        assert KeyFileProvider(path).load().hex() == results[0]
        assert _mode(path) == 0o600


# ------------------------------------------------------------------------------------------------
# EnvKeyProvider and default_master_key_provider
# ------------------------------------------------------------------------------------------------

KEY = bytes(range(KEY_BYTES))


@pytest.mark.parametrize(
    "text",
    [
        KEY.hex(),
        KEY.hex().upper(),
        f"  {KEY.hex()}\n",
        base64.urlsafe_b64encode(KEY).decode(),
        base64.urlsafe_b64encode(KEY).decode().rstrip("="),
        base64.b64encode(KEY).decode(),
    ],
)
def test_env_key_provider_accepts_hex_and_base64(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(MASTER_KEY_ENV, text)
    assert EnvKeyProvider().load() == KEY


def test_env_key_provider_accepts_base64_with_urlsafe_characters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = b"\xfb\xff\xbf" * 10 + b"\xfe\xff"  # encodes to '-' and '_' in urlsafe base64
    text = base64.urlsafe_b64encode(key).decode()
    assert "-" in text and "_" in text
    monkeypatch.setenv(MASTER_KEY_ENV, text)
    assert EnvKeyProvider().load() == key


@pytest.mark.parametrize(
    "text",
    [
        bytes(31).hex(),
        bytes(33).hex(),
        bytes(32).hex()[:-1],  # odd number of hex digits
        base64.urlsafe_b64encode(bytes(31)).decode(),
        base64.urlsafe_b64encode(bytes(33)).decode(),
        base64.urlsafe_b64encode(bytes(16)).decode(),
        "not a key at all",
    ],
)
def test_env_key_provider_refuses_bad_lengths(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(MASTER_KEY_ENV, text)
    with pytest.raises(MasterKeyError):
        EnvKeyProvider().load()


@pytest.mark.parametrize("value", [None, ""])
def test_env_key_provider_refuses_unset_or_empty(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(MASTER_KEY_ENV, value)
    with pytest.raises(MasterKeyError, match="not set"):
        EnvKeyProvider().load()


def test_env_key_provider_custom_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    monkeypatch.setenv("TENANTKV_TEST_OTHER_KEY", KEY.hex())
    assert EnvKeyProvider("TENANTKV_TEST_OTHER_KEY").load() == KEY
    with pytest.raises(MasterKeyError):
        EnvKeyProvider().load()


def test_default_provider_prefers_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key_file = tmp_path / "master.key"
    monkeypatch.setenv(MASTER_KEY_ENV, KEY.hex())
    provider = default_master_key_provider(key_file)
    assert isinstance(provider, EnvKeyProvider)
    assert provider.load() == KEY
    assert not key_file.exists()  # the key file is neither read nor created


def test_default_provider_prefers_environment_over_existing_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key_file = tmp_path / "master.key"
    file_key = KeyFileProvider(key_file).load()
    assert file_key != KEY
    monkeypatch.setenv(MASTER_KEY_ENV, KEY.hex())
    assert default_master_key_provider(key_file).load() == KEY


@pytest.mark.parametrize("value", [None, ""])
def test_default_provider_falls_back_to_key_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(MASTER_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(MASTER_KEY_ENV, value)
    key_file = tmp_path / "master.key"
    provider = default_master_key_provider(key_file)
    assert isinstance(provider, KeyFileProvider)
    key = provider.load()
    assert key_file.exists() and _mode(key_file) == 0o600
    assert KeyFileProvider(key_file).load() == key


# ------------------------------------------------------------------------------------------------
# KeyEncryptionKey
# ------------------------------------------------------------------------------------------------

KEK_BYTES = bytes(range(100, 100 + KEY_BYTES))
CONTEXT = b"tenant=0123456789abcdef/version=1/purpose=data"
WRAP_AAD_PREFIX = b"tenantkv/wrap/v1\x00"


def test_kek_is_a_key_wrapper() -> None:
    assert isinstance(KeyEncryptionKey(KEK_BYTES), KeyWrapper)


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_kek_refuses_wrong_key_length(length: int) -> None:
    with pytest.raises(MasterKeyError):
        KeyEncryptionKey(bytes(length))
    KeyEncryptionKey(bytes(KEY_BYTES))  # positive control


@settings(max_examples=50, deadline=None)
@given(key=st.binary(max_size=64), context=st.binary(max_size=64))
def test_wrap_unwrap_round_trip(key: bytes, context: bytes) -> None:
    kek = KeyEncryptionKey(KEK_BYTES)
    blob = kek.wrap(key, context)
    assert kek.unwrap(blob, context) == key
    # A fresh instance over the same master key opens it too.
    assert KeyEncryptionKey(KEK_BYTES).unwrap(blob, context) == key


def test_wrap_format_matches_the_documented_layout() -> None:
    key = new_key()
    blob = KeyEncryptionKey(KEK_BYTES).wrap(key, CONTEXT)
    assert len(blob) == 1 + 1 + 12 + len(key) + TAG_BYTES
    assert blob[0] == 1  # format version
    assert blob[1] == int(CipherSuite.AES_256_GCM) == 1
    nonce, sealed = blob[2:14], blob[14:]
    # Re-open with the bare primitive and the documented associated data.
    assert AESGCM(KEK_BYTES).decrypt(nonce, sealed, WRAP_AAD_PREFIX + CONTEXT) == key
    # The key never appears in clear.
    assert key not in blob


def test_wrap_uses_fresh_nonces() -> None:
    kek = KeyEncryptionKey(KEK_BYTES)
    key = new_key()
    blobs = [kek.wrap(key, CONTEXT) for _ in range(64)]
    assert len({blob[2:14] for blob in blobs}) == len(blobs)
    assert len(set(blobs)) == len(blobs)
    assert all(kek.unwrap(blob, CONTEXT) == key for blob in blobs)


@pytest.fixture
def wrapped() -> tuple[KeyEncryptionKey, bytes, bytes]:
    kek = KeyEncryptionKey(KEK_BYTES)
    key = new_key()
    blob = kek.wrap(key, CONTEXT)
    assert kek.unwrap(blob, CONTEXT) == key  # positive control for every negative case below
    return kek, key, blob


@pytest.mark.parametrize(
    "other_context",
    [b"", CONTEXT[:-1], CONTEXT + b"\x00", CONTEXT.replace(b"version=1", b"version=2")],
)
def test_unwrap_with_another_context_fails(
    wrapped: tuple[KeyEncryptionKey, bytes, bytes], other_context: bytes
) -> None:
    kek, _, blob = wrapped
    with pytest.raises(SealOpenError):
        kek.unwrap(blob, other_context)


def test_unwrap_context_is_not_confused_with_the_prefix() -> None:
    """The context is bound after a NUL-terminated label: b'' and b'\\x00' differ."""
    kek = KeyEncryptionKey(KEK_BYTES)
    blob = kek.wrap(KEY, b"")
    assert kek.unwrap(blob, b"") == KEY
    with pytest.raises(SealOpenError):
        kek.unwrap(blob, b"\x00")


def test_unwrap_with_another_kek_fails(wrapped: tuple[KeyEncryptionKey, bytes, bytes]) -> None:
    _, _, blob = wrapped
    with pytest.raises(SealOpenError):
        KeyEncryptionKey(new_key()).unwrap(blob, CONTEXT)
    with pytest.raises(SealOpenError):
        KeyEncryptionKey(bytes([KEK_BYTES[0] ^ 1]) + KEK_BYTES[1:]).unwrap(blob, CONTEXT)


def test_unwrap_with_any_byte_flipped_fails(
    wrapped: tuple[KeyEncryptionKey, bytes, bytes],
) -> None:
    kek, _, blob = wrapped
    for index in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[index] ^= mask
            with pytest.raises(SealOpenError):
                kek.unwrap(bytes(bad), CONTEXT)


@settings(max_examples=50, deadline=None)
@given(key=st.binary(max_size=48), data=st.data())
def test_unwrap_with_any_single_bit_flipped_fails(key: bytes, data: st.DataObject) -> None:
    kek = KeyEncryptionKey(KEK_BYTES)
    blob = kek.wrap(key, CONTEXT)
    assert kek.unwrap(blob, CONTEXT) == key
    bit = data.draw(st.integers(0, 8 * len(blob) - 1), label="bit")
    bad = bytearray(blob)
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(SealOpenError):
        kek.unwrap(bytes(bad), CONTEXT)


def test_unwrap_truncated_or_extended_blob_fails(
    wrapped: tuple[KeyEncryptionKey, bytes, bytes],
) -> None:
    kek, _, blob = wrapped
    for length in range(len(blob)):
        with pytest.raises(SealOpenError):
            kek.unwrap(blob[:length], CONTEXT)
    with pytest.raises(SealOpenError):
        kek.unwrap(blob + b"\x00", CONTEXT)


@pytest.mark.parametrize(
    ("position", "value"),
    [(0, 0), (0, 2), (0, 255), (1, 0), (1, CipherSuite.AES_256_OCB3), (1, 255)],
)
def test_unwrap_unknown_version_or_suite_byte_fails(
    wrapped: tuple[KeyEncryptionKey, bytes, bytes], position: int, value: int
) -> None:
    kek, _, blob = wrapped
    bad = bytearray(blob)
    bad[position] = value
    with pytest.raises(SealOpenError):
        kek.unwrap(bytes(bad), CONTEXT)


def test_crypto_errors_share_a_base() -> None:
    assert issubclass(SealOpenError, CryptoError)
    assert issubclass(MasterKeyError, CryptoError)
    assert not issubclass(SealOpenError, MasterKeyError)


# ------------------------------------------------------------------------------------------------
# ExtentCipher
# ------------------------------------------------------------------------------------------------

TENANT = bytes(range(1, 17))
NAMESPACE = bytes(range(200, 216))
BLOCK_KEY = bytes(range(50, 50 + BLOCK_KEY_BYTES))
DATA_KEY = bytes(range(150, 150 + KEY_BYTES))
SALT = bytes(range(30, 30 + SALT_BYTES))


@dataclass(frozen=True)
class SealParams:
    """Everything a sealed segment depends on."""

    data_key: bytes = DATA_KEY
    salt: bytes = SALT
    tenant_id: bytes = TENANT
    key_version: int = 7
    namespace_id: bytes = NAMESPACE
    suite: CipherSuite = CipherSuite.AES_256_GCM
    block_key: bytes = BLOCK_KEY
    layer: int = 3
    slot: int = 5

    def cipher(self) -> ExtentCipher:
        context = SegmentContext(self.tenant_id, self.key_version, self.namespace_id)
        return ExtentCipher(self.data_key, self.salt, context, self.suite)


def seal(params: SealParams, plaintext: bytes) -> bytes:
    out = bytearray(len(plaintext) + TAG_BYTES)
    params.cipher().seal_into(
        params.slot, params.layer, params.block_key, memoryview(plaintext), memoryview(out)
    )
    return bytes(out)


def open_sealed(params: SealParams, sealed: bytes) -> bytes:
    out = bytearray(len(sealed) - TAG_BYTES)
    params.cipher().open_into(
        params.slot, params.layer, params.block_key, memoryview(sealed), memoryview(out)
    )
    return bytes(out)


def _flip(value: bytes) -> bytes:
    return bytes([value[0] ^ 1]) + value[1:]


# Each entry changes exactly one input of the seal.
CHANGES: dict[str, Callable[[SealParams], SealParams]] = {
    "tenant_id": lambda p: replace(p, tenant_id=_flip(p.tenant_id)),
    "key_version": lambda p: replace(p, key_version=p.key_version + 1),
    "namespace_id": lambda p: replace(p, namespace_id=_flip(p.namespace_id)),
    "block_key": lambda p: replace(p, block_key=_flip(p.block_key)),
    "block_key_last_byte": lambda p: replace(
        p, block_key=p.block_key[:-1] + bytes([p.block_key[-1] ^ 0x80])
    ),
    "layer": lambda p: replace(p, layer=p.layer + 1),
    "slot": lambda p: replace(p, slot=p.slot + 1),
    "salt": lambda p: replace(p, salt=_flip(p.salt)),
    "data_key": lambda p: replace(p, data_key=_flip(p.data_key)),
    "suite": lambda p: replace(
        p,
        suite=CipherSuite.AES_256_OCB3
        if p.suite is CipherSuite.AES_256_GCM
        else CipherSuite.AES_256_GCM,
    ),
    "layer_and_slot_swapped": lambda p: replace(p, layer=p.slot, slot=p.layer),
}


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_seal_open_round_trip_each_suite(suite: CipherSuite) -> None:
    params = SealParams(suite=suite)
    plaintext = os.urandom(300)
    sealed = seal(params, plaintext)
    assert len(sealed) == len(plaintext) + TAG_BYTES
    assert sealed[: len(plaintext)] != plaintext
    assert open_sealed(params, sealed) == plaintext
    # The same extent parameters in a fresh cipher instance open it too.
    assert open_sealed(replace(params), sealed) == plaintext


@settings(max_examples=50, deadline=None)
@given(
    suite=st.sampled_from(SUITES),
    plaintext=st.binary(max_size=256),
    layer=st.integers(0, 2**32 - 1),
    slot=st.integers(0, 2**64 - 1),
    key_version=st.integers(0, 2**32 - 1),
    block_key=st.binary(min_size=BLOCK_KEY_BYTES, max_size=BLOCK_KEY_BYTES),
)
def test_seal_open_round_trip_property(
    suite: CipherSuite,
    plaintext: bytes,
    layer: int,
    slot: int,
    key_version: int,
    block_key: bytes,
) -> None:
    params = SealParams(
        suite=suite, layer=layer, slot=slot, key_version=key_version, block_key=block_key
    )
    sealed = seal(params, plaintext)
    assert len(sealed) == len(plaintext) + TAG_BYTES
    assert open_sealed(params, sealed) == plaintext


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_open_with_one_input_changed_fails(suite: CipherSuite, change: str) -> None:
    params = SealParams(suite=suite)
    plaintext = os.urandom(64)
    sealed = seal(params, plaintext)
    assert open_sealed(params, sealed) == plaintext  # positive control
    other = CHANGES[change](params)
    assert other != params
    with pytest.raises(SealOpenError):
        open_sealed(other, sealed)


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_open_failure_does_not_depend_on_the_plaintext(suite: CipherSuite) -> None:
    """An empty segment is still bound to its place: the tag alone authenticates the AAD."""
    params = SealParams(suite=suite)
    sealed = seal(params, b"")
    assert len(sealed) == TAG_BYTES
    assert open_sealed(params, sealed) == b""
    for change in CHANGES.values():
        with pytest.raises(SealOpenError):
            open_sealed(change(params), sealed)


@settings(max_examples=50, deadline=None)
@given(suite=st.sampled_from(SUITES), plaintext=st.binary(max_size=64), data=st.data())
def test_any_single_bit_flip_fails(
    suite: CipherSuite, plaintext: bytes, data: st.DataObject
) -> None:
    params = SealParams(suite=suite)
    sealed = seal(params, plaintext)
    assert open_sealed(params, sealed) == plaintext
    bit = data.draw(st.integers(0, 8 * len(sealed) - 1), label="bit")
    bad = bytearray(sealed)
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(SealOpenError):
        open_sealed(params, bytes(bad))


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_truncated_or_extended_segment_fails(suite: CipherSuite) -> None:
    params = SealParams(suite=suite)
    plaintext = os.urandom(40)
    sealed = seal(params, plaintext)
    assert open_sealed(params, sealed) == plaintext
    for length in range(TAG_BYTES, len(sealed)):
        with pytest.raises(SealOpenError):
            open_sealed(params, sealed[:length])  # output sized to match: length is bound too
        with pytest.raises(SealOpenError):
            open_sealed(params, sealed[len(sealed) - length :])
    with pytest.raises(SealOpenError):
        open_sealed(params, sealed + b"\x00")


def test_segments_swapped_between_slots_fail() -> None:
    params = SealParams()
    a = seal(replace(params, slot=0), b"A" * 32)
    b = seal(replace(params, slot=1), b"B" * 32)
    assert open_sealed(replace(params, slot=0), a) == b"A" * 32
    assert open_sealed(replace(params, slot=1), b) == b"B" * 32
    with pytest.raises(SealOpenError):
        open_sealed(replace(params, slot=0), b)
    with pytest.raises(SealOpenError):
        open_sealed(replace(params, slot=1), a)


@pytest.mark.parametrize("delta", [-1, 1, 16])
def test_seal_with_wrong_output_length_raises_value_error(delta: int) -> None:
    cipher = SealParams().cipher()
    plaintext = memoryview(bytes(32))
    with pytest.raises(ValueError):
        cipher.seal_into(0, 0, BLOCK_KEY, plaintext, memoryview(bytearray(32 + TAG_BYTES + delta)))
    cipher.seal_into(0, 0, BLOCK_KEY, plaintext, memoryview(bytearray(32 + TAG_BYTES)))


@pytest.mark.parametrize("out_length", [0, 31, 33, 48])
def test_open_with_wrong_output_length_raises_seal_open_error(out_length: int) -> None:
    params = SealParams()
    sealed = seal(params, bytes(32))
    cipher = params.cipher()
    with pytest.raises(SealOpenError):
        cipher.open_into(
            params.slot,
            params.layer,
            params.block_key,
            memoryview(sealed),
            memoryview(bytearray(out_length)),
        )
    out = bytearray(32)
    cipher.open_into(
        params.slot, params.layer, params.block_key, memoryview(sealed), memoryview(out)
    )
    assert out == bytes(32)


@pytest.mark.parametrize("sealed_length", range(TAG_BYTES))
def test_open_of_segment_shorter_than_a_tag_fails(sealed_length: int) -> None:
    cipher = SealParams().cipher()
    with pytest.raises(SealOpenError):
        cipher.open_into(
            0, 0, BLOCK_KEY, memoryview(bytes(sealed_length)), memoryview(bytearray(0))
        )


@pytest.mark.parametrize("length", [0, 16, 31, 33])
def test_block_key_of_wrong_length_is_refused(length: int) -> None:
    cipher = SealParams().cipher()
    with pytest.raises(ValueError):
        cipher.associated_data(bytes(length), 0, 0)
    with pytest.raises(ValueError):
        cipher.seal_into(0, 0, bytes(length), memoryview(b""), memoryview(bytearray(TAG_BYTES)))
    assert len(cipher.associated_data(bytes(BLOCK_KEY_BYTES), 0, 0)) == 85


def test_extent_cipher_refuses_wrong_key_or_salt_length() -> None:
    context = SegmentContext(TENANT, 1, NAMESPACE)
    for bad_key in (b"", bytes(16), bytes(31), bytes(33)):
        with pytest.raises(ValueError):
            ExtentCipher(bad_key, SALT, context, DEFAULT_SUITE)
    for bad_salt in (b"", bytes(12), bytes(15), bytes(17), bytes(32)):
        with pytest.raises(ValueError):
            ExtentCipher(DATA_KEY, bad_salt, context, DEFAULT_SUITE)
    ExtentCipher(DATA_KEY, SALT, context, DEFAULT_SUITE)  # positive control


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tenant_id": bytes(15)},
        {"tenant_id": bytes(17)},
        {"namespace_id": b""},
        {"namespace_id": bytes(32)},
        {"key_version": -1},
        {"key_version": 2**32},
    ],
)
def test_segment_context_validation(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {"tenant_id": TENANT, "key_version": 1, "namespace_id": NAMESPACE}
    with pytest.raises(ValueError):
        SegmentContext(**{**base, **kwargs})
    SegmentContext(**base)  # positive control
    SegmentContext(TENANT, 0, NAMESPACE)
    SegmentContext(TENANT, 2**32 - 1, NAMESPACE)


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_associated_data_layout_byte_by_byte(suite: CipherSuite) -> None:
    key_version = 0x01020304
    layer = 0xA0B0C0D0
    length = 0x11223344
    cipher = SealParams(suite=suite, key_version=key_version).cipher()
    aad = cipher.associated_data(BLOCK_KEY, layer, length)

    def field(offset: int, size: int) -> bytes:
        return aad[offset : offset + size]

    assert len(aad) == 85
    assert field(0, 8) == b"TKVSEG\x00\x01"
    assert aad[7] == SEGMENT_FORMAT_VERSION == 1
    assert field(8, 1) == bytes([int(suite)])
    assert field(9, 16) == TENANT
    assert field(25, 4) == b"\x01\x02\x03\x04"
    assert field(29, 16) == NAMESPACE
    assert field(45, 32) == BLOCK_KEY
    assert field(77, 4) == b"\xa0\xb0\xc0\xd0"
    assert field(81, 4) == b"\x11\x22\x33\x44"
    # The fields tile the record with no gaps: rebuild it from the table.
    expected = (
        b"TKVSEG\x00\x01"
        + bytes([int(suite)])
        + TENANT
        + key_version.to_bytes(4, "big")
        + NAMESPACE
        + BLOCK_KEY
        + layer.to_bytes(4, "big")
        + length.to_bytes(4, "big")
    )
    assert aad == expected


def test_associated_data_reflects_each_input() -> None:
    params = SealParams()
    base = params.cipher().associated_data(BLOCK_KEY, 3, 10)
    assert params.cipher().associated_data(BLOCK_KEY, 3, 10) == base
    assert params.cipher().associated_data(BLOCK_KEY, 4, 10) != base
    assert params.cipher().associated_data(BLOCK_KEY, 3, 11) != base
    assert params.cipher().associated_data(_flip(BLOCK_KEY), 3, 10) != base
    for change in ("tenant_id", "key_version", "namespace_id", "suite"):
        assert CHANGES[change](params).cipher().associated_data(BLOCK_KEY, 3, 10) != base
    # Salt and data key go into the subkey, not the associated data.
    for change in ("salt", "data_key"):
        assert CHANGES[change](params).cipher().associated_data(BLOCK_KEY, 3, 10) == base


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_sealed_segment_matches_documented_construction(suite: CipherSuite) -> None:
    """Re-open a segment with the bare primitive, the documented subkey, nonce and AAD."""
    layer, slot = 0x0A0B0C0D, 0x0102030405060708
    params = SealParams(suite=suite, layer=layer, slot=slot)
    plaintext = os.urandom(100)
    sealed = seal(params, plaintext)
    subkey = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=SALT,
        info=b"tenantkv/segment/v1" + bytes([int(suite)]),
    ).derive(DATA_KEY)
    nonce = struct.pack(">IQ", layer, slot)
    assert nonce == layer.to_bytes(4, "big") + slot.to_bytes(8, "big")
    aad = params.cipher().associated_data(BLOCK_KEY, layer, len(plaintext))
    aead = AESGCM(subkey) if suite is CipherSuite.AES_256_GCM else AESOCB3(subkey)
    assert aead.decrypt(nonce, sealed, aad) == plaintext


# Layer/slot pairs chosen so that a sloppy nonce packing (sum, xor, overlapping fields, or
# truncation to fewer bits) would collide somewhere.
TRICKY_POSITIONS = [
    (0, 0),
    (0, 1),
    (1, 0),
    (1, 1),
    (0, 2**32),
    (1, 2**32),
    (0, 2**32 + 1),
    (2**31, 0),
    (0, 2**63),
    (0, 2**64 - 1),
    (2**32 - 1, 0),
    (2**32 - 1, 2**64 - 1),
    (2, 3),
    (3, 2),
]


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_nonces_are_injective_in_layer_and_slot(suite: CipherSuite) -> None:
    """Identical plaintext in distinct (layer, slot) positions gives distinct keystreams.

    The ciphertext bodies (not just the tags, which differ anyway through the AAD) must differ,
    otherwise two positions would share a nonce under one subkey.
    """
    params = SealParams(suite=suite)
    plaintext = bytes(64)  # all zeros: a body equals its keystream (GCM) / block output (OCB)
    positions = sorted({(layer, slot) for layer in range(4) for slot in range(8)}) + [
        p for p in TRICKY_POSITIONS if not (p[0] < 4 and p[1] < 8)
    ]
    bodies: dict[bytes, tuple[int, int]] = {}
    for layer, slot in positions:
        sealed = seal(replace(params, layer=layer, slot=slot), plaintext)
        body = sealed[: len(plaintext)]
        assert body not in bodies, f"({layer}, {slot}) repeats the body of {bodies.get(body)}"
        bodies[body] = (layer, slot)
        assert open_sealed(replace(params, layer=layer, slot=slot), sealed) == plaintext
    assert len(bodies) == len(positions)


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_sealing_is_deterministic_per_position(suite: CipherSuite) -> None:
    """Positive control for the nonce tests: same extent, same position -> same bytes."""
    params = SealParams(suite=suite)
    plaintext = bytes(64)
    assert seal(params, plaintext) == seal(replace(params), plaintext)


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_extents_with_different_salts_give_different_ciphertexts(suite: CipherSuite) -> None:
    plaintext = bytes(64)
    salts = [new_salt() for _ in range(16)] + [SALT, _flip(SALT)]
    for layer, slot in [(0, 0), (3, 5)]:
        bodies = {
            seal(SealParams(suite=suite, salt=salt, layer=layer, slot=slot), plaintext)[:64]
            for salt in salts
        }
        assert len(bodies) == len(salts)


def test_suites_give_different_ciphertexts() -> None:
    plaintext = bytes(64)
    gcm = seal(SealParams(suite=CipherSuite.AES_256_GCM), plaintext)
    ocb = seal(SealParams(suite=CipherSuite.AES_256_OCB3), plaintext)
    assert gcm[:64] != ocb[:64]


def test_cipher_is_shared_across_threads() -> None:
    params = SealParams()
    cipher = params.cipher()
    plaintexts = [os.urandom(128) for _ in range(32)]
    sealed = [seal(replace(params, slot=i), p) for i, p in enumerate(plaintexts)]
    failures: list[int] = []

    def worker(start: int) -> None:
        for i in range(start, len(plaintexts), 4):
            out = bytearray(128)
            cipher.open_into(i, params.layer, BLOCK_KEY, memoryview(sealed[i]), memoryview(out))
            if bytes(out) != plaintexts[i]:
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


# ------------------------------------------------------------------------------------------------
# CipherSuite and random keys
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("aes-256-gcm", CipherSuite.AES_256_GCM),
        ("AES-256-GCM", CipherSuite.AES_256_GCM),
        ("aes_256_gcm", CipherSuite.AES_256_GCM),
        ("AES_256_OCB3", CipherSuite.AES_256_OCB3),
        ("aes-256-ocb3", CipherSuite.AES_256_OCB3),
        ("  Aes-256-Ocb3\n", CipherSuite.AES_256_OCB3),
        (1, CipherSuite.AES_256_GCM),
        (2, CipherSuite.AES_256_OCB3),
        (CipherSuite.AES_256_OCB3, CipherSuite.AES_256_OCB3),
    ],
)
def test_cipher_suite_parse_accepts(value: str | int | CipherSuite, expected: CipherSuite) -> None:
    assert CipherSuite.parse(value) is expected


@pytest.mark.parametrize(
    "value",
    ["", "aes", "aes-128-gcm", "chacha20-poly1305", "aes-256-gcm-siv", "gcm", 0, 3, -1, True],
)
def test_cipher_suite_parse_refuses_unknown(value: str | int) -> None:
    with pytest.raises(ValueError):
        CipherSuite.parse(value)


def test_cipher_suite_numbers_are_stable() -> None:
    assert int(CipherSuite.AES_256_GCM) == 1
    assert int(CipherSuite.AES_256_OCB3) == 2
    assert DEFAULT_SUITE is CipherSuite.AES_256_GCM
    assert len(CipherSuite) == 2


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_cipher_suite_new_aead(suite: CipherSuite) -> None:
    aead = suite.new_aead(DATA_KEY)
    nonce = bytes(12)
    assert aead.decrypt(nonce, aead.encrypt(nonce, b"hello", b"ad"), b"ad") == b"hello"
    for bad in (b"", bytes(16), bytes(31), bytes(33)):
        with pytest.raises(ValueError):
            suite.new_aead(bad)


def test_new_key_and_new_salt() -> None:
    keys = {new_key() for _ in range(64)}
    salts = {new_salt() for _ in range(64)}
    assert len(keys) == 64 and all(len(k) == KEY_BYTES for k in keys)
    assert len(salts) == 64 and all(len(s) == SALT_BYTES for s in salts)
    assert ID_BYTES == 16 and BLOCK_KEY_BYTES == 32 and SALT_BYTES == 16


def test_seal_many_into_equals_seal_into_per_segment() -> None:
    """The batched seal is the per-segment seal, segment for segment: the same bytes, and each
    opens only at its own slot with its own block key (stores use the batch, loads open what it
    wrote)."""
    cipher = SealParams().cipher()
    length, count, first, layer = 48, 5, 7, 3
    keys = [bytes([i]) * BLOCK_KEY_BYTES for i in range(count)]
    plaintexts = [memoryview(bytes([65 + i]) * length) for i in range(count)]
    stride = length + TAG_BYTES
    batched = bytearray(count * stride)
    cipher.seal_many_into(first, layer, keys, plaintexts, memoryview(batched))
    one_by_one = bytearray(count * stride)
    for j in range(count):
        out = memoryview(one_by_one)[j * stride : (j + 1) * stride]
        cipher.seal_into(first + j, layer, keys[j], plaintexts[j], out)
    assert batched == one_by_one
    outs = [memoryview(bytearray(length)) for _ in range(count)]
    cipher.open_many_into(first, layer, keys, memoryview(batched), outs)
    assert [bytes(o) for o in outs] == [bytes(p) for p in plaintexts]
    with pytest.raises(SealOpenError):  # one slot off: every segment fails to open
        cipher.open_many_into(first + 1, layer, keys, memoryview(batched), outs)
    with pytest.raises(SealOpenError):  # keys swapped
        cipher.open_many_into(first, layer, keys[::-1], memoryview(batched), outs)


@pytest.mark.parametrize("what", ["output", "plaintext", "key", "slot"])
def test_seal_many_into_refuses_inconsistent_arguments(what: str) -> None:
    cipher = SealParams().cipher()
    keys = [BLOCK_KEY, BLOCK_KEY]
    plaintexts = [memoryview(bytes(32)), memoryview(bytes(32))]
    out = memoryview(bytearray(2 * (32 + TAG_BYTES)))
    first = 0
    if what == "output":
        out = out[:-1]
    elif what == "plaintext":
        plaintexts[1] = memoryview(bytes(31))
    elif what == "key":
        keys[1] = BLOCK_KEY[:-1]
    else:
        first = 2**64 - 1  # the second segment's slot is out of range
    with pytest.raises(ValueError):
        cipher.seal_many_into(first, 0, keys, plaintexts, out)
    whole = memoryview(bytearray(2 * (32 + TAG_BYTES)))  # positive control
    cipher.seal_many_into(0, 0, [BLOCK_KEY] * 2, [memoryview(bytes(32))] * 2, whole)
