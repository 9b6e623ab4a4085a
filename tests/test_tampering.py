"""Tampered, moved, truncated or missing extents never yield wrong data.

Every attack starts from a prefix the owner demonstrably has (lookup hits, the load returns exactly
the stored bytes); then the extent file is attacked on disk. Two failure classes follow:

* bytes that fail to open (flipped, swapped, moved, relabelled, grown): the load raises
  :class:`tenantkv.SegmentIntegrityError` (a :class:`tenantkv.LoadError`) whose
  ``delivered_layers`` counts exactly the intact layers handed over before the damage, every
  layer handed over is the exact stored data, the extent is dropped from the index (the
  following lookup is shorter) and from disk, and a ``segment_open_failed`` security event is
  recorded;
* bytes that are gone or shorter than indexed (deleted, truncated) are *lost*: a miss
  (:class:`tenantkv.CacheMissError`, before any layer), the index forgets the extent, the
  ``lost_extents`` health counter grows, and no security event is recorded -- a shared tier
  that evicted the bytes or a disk that lost them is not an attack, and a disk attacker can
  always delete. Never wrong data, in either class.

The last tests leave the bytes alone and edit the index's rows instead, as an operator with
database access (and no master key) could.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

import tenantkv
from tenantkv import KVLayout, TenantKV, crypto
from tenantkv.datapath.extent_format import HEADER_BYTES, ExtentGeometry
from tenantkv.index.schema import Block, Extent

from .helpers import MHA_SMALL, MLA_SMALL, prefix_of, random_layers, random_tokens

TAG_BYTES = crypto.TAG_BYTES
NUM_BLOCKS = 3
NUM_TOKENS = NUM_BLOCKS * 64
EVENT = "segment_open_failed"
LAYOUTS = {"mla": MLA_SMALL, "mha": MHA_SMALL}


def bytes_of(layer: tenantkv.Layer) -> bytes:
    if isinstance(layer, torch.Tensor):
        return layer.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes_of(layer[0]) + bytes_of(layer[1])


def extent_files(cache_root: Path) -> set[Path]:
    return set((cache_root / "blocks" / "extents").glob("*/*.tkx"))


@dataclass
class Stored:
    """One store call's prefix: its namespace, tokens, exact layer bytes and extent file."""

    ns: tenantkv.Namespace
    tokens: list[int]
    expected: list[bytes]  # per layer, bytes of all of ``tokens``
    extent: Path
    geometry: ExtentGeometry

    def segment(self, layer: int, slot: int) -> slice:
        start = self.geometry.offset(layer, slot)
        return slice(start, start + self.geometry.sealed_bytes)


def store_prefix(
    kv: TenantKV,
    cache_root: Path,
    tenant: str,
    layout: KVLayout,
    tokens: list[int],
    *,
    seed: int,
    scope: str | None = None,
    new_tokens: int | None = None,
    layers: list[tenantkv.Layer] | None = None,
) -> Stored:
    """Store ``tokens`` and check the owner gets a hit and the exact bytes back."""
    if tenant not in {t.name for t in kv.list_tenants()}:
        kv.create_tenant(tenant)
    ns = kv.namespace(tenant, model="tamper-model", layout=layout, scope=scope)
    if layers is None:
        layers = list(random_layers(layout, len(tokens), seed=seed))
    before = extent_files(cache_root)
    stored = len(tokens) if new_tokens is None else new_tokens
    assert ns.store(tokens, layers) == stored
    created = extent_files(cache_root) - before
    assert len(created) == 1
    (extent,) = created
    geometry = ExtentGeometry(
        num_blocks=stored // 64,
        num_layers=layout.num_layers,
        segment_bytes=64 * layout.token_bytes,
        suite=kv.config.suite,
    )
    assert extent.stat().st_size == geometry.total_bytes
    # Layout check of the formula the attacks rely on.
    assert geometry.offset(1, 1) == HEADER_BYTES + (1 * geometry.num_blocks + 1) * (
        geometry.segment_bytes + TAG_BYTES
    )
    expected = [bytes_of(layer) for layer in layers]
    # Positive control: the owner has a hit and loads exactly what it stored.
    assert ns.lookup(tokens) == len(tokens)
    assert load_bytes(ns, tokens) == expected
    return Stored(ns, tokens, expected, extent, geometry)


def load_bytes(ns: tenantkv.Namespace, tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    with ns.load(tokens) as stream:
        for index, layer in stream:
            assert index == len(out)
            out.append(bytes_of(layer))
    return out


def expect_integrity_failure(victim: Stored, expected_delivered: int) -> tenantkv.LoadError:
    """Load the attacked prefix: every layer handed over is exact, then a typed error."""
    delivered = 0
    # ns.load() itself raises for a missing/relabelled extent; iteration raises for a segment.
    with (
        pytest.raises(tenantkv.SegmentIntegrityError) as info,
        victim.ns.load(victim.tokens) as stream,
    ):
        for index, layer in stream:
            assert index == delivered
            assert bytes_of(layer) == victim.expected[index], f"layer {index} is wrong"
            delivered += 1
    error = info.value
    assert isinstance(error, tenantkv.LoadError)
    assert delivered == expected_delivered
    assert error.delivered_layers == expected_delivered
    return error


def expect_lost(victim: Stored) -> None:
    """Load a prefix whose bytes are gone or short: a miss, before any layer."""
    with pytest.raises(tenantkv.CacheMissError):
        victim.ns.load(victim.tokens)


def assert_forgotten(kv: TenantKV, victim: Stored, *, lost: int = 1) -> None:
    """A lost extent is out of the index and off disk, counted, and no security event."""
    assert victim.ns.lookup(victim.tokens) == 0
    assert not victim.extent.exists()
    assert kv.health_counters().get("lost_extents", 0) == lost
    assert kv.security_events().get(EVENT, 0) == 0


def expect_failure(kv: TenantKV, attack_name: str, victim: Stored, delivered: int) -> None:
    """The failure class the attack calls for, and its consequences."""
    if attack_name in LOST_ATTACKS:
        expect_lost(victim)
        assert_forgotten(kv, victim)
    else:
        expect_integrity_failure(victim, delivered)
        assert_dropped(kv, victim)


def assert_dropped(kv: TenantKV, victim: Stored, *, remaining: int = 0, events: int = 1) -> None:
    """The damaged extent is out of the index and off disk, and the event was recorded."""
    assert victim.ns.lookup(victim.tokens) == remaining
    assert not victim.extent.exists()
    assert kv.security_events().get(EVENT, 0) == events
    last = kv.recent_security_events()[-1]
    assert last.kind == EVENT
    assert last.tenant == victim.ns.tenant
    assert victim.extent.stem in last.detail
    if remaining == 0:
        with pytest.raises(tenantkv.CacheMissError):
            victim.ns.load(victim.tokens[:64])


# ---- the attacks ------------------------------------------------------------------------------


@dataclass
class Scene:
    kv: TenantKV
    cache_root: Path
    layout: KVLayout
    victim: Stored
    bystander: Stored | None = None  # another namespace whose bytes an attack used

    @property
    def middle(self) -> int:
        return self.layout.num_layers // 2

    def other_tenant(self) -> Stored:
        """Tenant ``globex`` stores a same-shaped prefix (same tokens, different KV)."""
        self.bystander = store_prefix(
            self.kv, self.cache_root, "globex", self.layout, self.victim.tokens, seed=99
        )
        return self.bystander

    def same_tenant_other_scope(self) -> Stored:
        self.bystander = store_prefix(
            self.kv,
            self.cache_root,
            self.victim.ns.tenant,
            self.layout,
            self.victim.tokens,
            seed=98,
            scope="other-scope",
        )
        return self.bystander


Attack = Callable[[Scene], int]  # damages the victim's extent; returns the layers still delivered


def edit(path: Path, change: Callable[[bytearray], None]) -> None:
    data = bytearray(path.read_bytes())
    original = bytes(data)
    change(data)
    assert bytes(data) != original, "the attack changed nothing"
    path.write_bytes(data)


def flip_segment_byte(where: str) -> Attack:
    def attack(scene: Scene) -> int:
        victim = scene.victim
        plain = victim.geometry.segment_bytes
        inside = {
            "ciphertext-first": 0,
            "ciphertext-middle": plain // 2,
            "ciphertext-last": plain - 1,
            "tag-first": plain,
            "tag-last": plain + TAG_BYTES - 1,
        }[where]
        offset = victim.geometry.offset(scene.middle, 1) + inside

        def change(data: bytearray) -> None:
            data[offset] ^= 0x01

        edit(victim.extent, change)
        return scene.middle

    return attack


def truncate(keep: str) -> Attack:
    def attack(scene: Scene) -> int:
        size = scene.victim.geometry.total_bytes
        new_size = {
            "last-byte": size - 1,
            "last-tag": size - TAG_BYTES,
            "half": size // 2,
            "header-only": HEADER_BYTES,
            "empty": 0,
        }[keep]
        os.truncate(scene.victim.extent, new_size)
        assert scene.victim.extent.stat().st_size == new_size
        return 0  # the size is checked against the index before any layer is read

    return attack


def append_bytes(scene: Scene) -> int:
    with scene.victim.extent.open("ab") as handle:
        handle.write(b"\x00" * scene.victim.geometry.sealed_bytes)
    return 0


def swap_blocks_same_layer(scene: Scene) -> int:
    victim, layer = scene.victim, scene.middle
    first, second = victim.segment(layer, 0), victim.segment(layer, NUM_BLOCKS - 1)

    def change(data: bytearray) -> None:
        data[first], data[second] = data[second], data[first]

    edit(victim.extent, change)
    return layer


def swap_layers_same_block(scene: Scene) -> int:
    victim = scene.victim
    low, high = scene.layout.num_layers - 2, scene.layout.num_layers - 1
    first, second = victim.segment(low, 1), victim.segment(high, 1)

    def change(data: bytearray) -> None:
        data[first], data[second] = data[second], data[first]

    edit(victim.extent, change)
    return low


def copy_from_other_layer(scene: Scene) -> int:
    victim, layer = scene.victim, scene.middle
    source, target = victim.segment(0, 1), victim.segment(layer, 1)

    def change(data: bytearray) -> None:
        data[target] = data[source]

    edit(victim.extent, change)
    return layer


def copy_segment_from(other: Callable[[Scene], Stored]) -> Attack:
    def attack(scene: Scene) -> int:
        victim, layer = scene.victim, scene.middle
        donor = other(scene)
        assert donor.geometry == victim.geometry  # same offsets: a straight transplant
        span = victim.segment(layer, 1)
        donor_bytes = donor.extent.read_bytes()[span]

        def change(data: bytearray) -> None:
            data[span] = donor_bytes

        edit(victim.extent, change)
        return layer

    return attack


def replace_with_other_tenants_extent(scene: Scene) -> int:
    victim = scene.victim
    donor = scene.other_tenant()
    donor_bytes = donor.extent.read_bytes()
    # Same size and an identical header: only the sealing can tell the files apart.
    assert len(donor_bytes) == victim.extent.stat().st_size
    assert donor_bytes[:HEADER_BYTES] == victim.extent.read_bytes()[:HEADER_BYTES]
    shutil.copyfile(donor.extent, victim.extent)
    return 0


def edit_header(offset: int) -> Attack:
    def attack(scene: Scene) -> int:
        assert offset < HEADER_BYTES

        def change(data: bytearray) -> None:
            data[offset] ^= 0x01

        edit(scene.victim.extent, change)
        return 0

    return attack


def delete_extent(scene: Scene) -> int:
    scene.victim.extent.unlink()
    return 0


ATTACKS: dict[str, Attack] = {
    **{f"flip-{w}": flip_segment_byte(w) for w in ("ciphertext-first", "ciphertext-middle")},
    **{f"flip-{w}": flip_segment_byte(w) for w in ("ciphertext-last", "tag-first", "tag-last")},
    **{f"truncate-{k}": truncate(k) for k in ("last-byte", "last-tag", "half")},
    **{f"truncate-{k}": truncate(k) for k in ("header-only", "empty")},
    "append": append_bytes,
    "swap-blocks-same-layer": swap_blocks_same_layer,
    "swap-layers-same-block": swap_layers_same_block,
    "copy-from-other-layer": copy_from_other_layer,
    "copy-from-other-tenant": copy_segment_from(Scene.other_tenant),
    "copy-from-own-other-scope": copy_segment_from(Scene.same_tenant_other_scope),
    "replace-with-other-tenants-extent": replace_with_other_tenants_extent,
    # magic, version, suite, reserved u16, blocks, layers, segment bytes, reserved tail
    **{f"header-byte-{o}": edit_header(o) for o in (0, 3, 4, 5, 6, 7, 11, 15, 19, 20, 31)},
    "delete": delete_extent,
}

# Attacks that leave the bytes gone or short: lost, not an integrity failure.
LOST_ATTACKS = frozenset(
    {f"truncate-{k}" for k in ("last-byte", "last-tag", "half", "header-only", "empty")}
    | {"delete"}
)

# The whole attack list on the MLA layout, and a representative subset on MHA.
MHA_ATTACKS = (
    "flip-ciphertext-middle",
    "flip-tag-last",
    "truncate-half",
    "swap-blocks-same-layer",
    "swap-layers-same-block",
    "copy-from-other-layer",
    "copy-from-other-tenant",
    "replace-with-other-tenants-extent",
    "header-byte-19",
    "delete",
)
CASES = [pytest.param("mla", name, id=f"mla-{name}") for name in ATTACKS] + [
    pytest.param("mha", name, id=f"mha-{name}") for name in MHA_ATTACKS
]


def make_scene(kv: TenantKV, cache_root: Path, layout: KVLayout) -> Scene:
    tokens = random_tokens(NUM_TOKENS, seed=1)
    victim = store_prefix(kv, cache_root, "acme", layout, tokens, seed=1)
    assert kv.security_events().get(EVENT, 0) == 0
    return Scene(kv, cache_root, layout, victim)


@pytest.mark.parametrize(("layout_name", "attack_name"), CASES)
def test_attack_never_returns_wrong_data(
    kv: TenantKV, cache_root: Path, layout_name: str, attack_name: str
) -> None:
    scene = make_scene(kv, cache_root, LAYOUTS[layout_name])
    delivered = ATTACKS[attack_name](scene)
    # The index does not know yet: the lookup still claims the prefix ...
    assert scene.victim.ns.lookup(scene.victim.tokens) == NUM_TOKENS
    # ... but the load refuses it, after handing over only intact layers (or none: lost).
    expect_failure(kv, attack_name, scene.victim, delivered)
    if scene.bystander is not None:
        # The namespace whose bytes were borrowed is untouched and still loads exactly.
        assert scene.bystander.extent.exists()
        assert scene.bystander.ns.lookup(scene.bystander.tokens) == NUM_TOKENS
        assert load_bytes(scene.bystander.ns, scene.bystander.tokens) == scene.bystander.expected
        assert kv.security_events()[EVENT] == 1


def test_random_access_reports_only_gapless_delivery(kv: TenantKV, cache_root: Path) -> None:
    """``wait_for_layer`` out of order: delivered_layers counts layers from 0 without a gap."""
    scene = make_scene(kv, cache_root, MLA_SMALL)
    damaged = flip_segment_byte("ciphertext-middle")(scene)
    last = MLA_SMALL.num_layers - 1
    assert damaged < last
    victim = scene.victim
    with victim.ns.load(victim.tokens) as stream:
        assert bytes_of(stream.wait_for_layer(last)) == victim.expected[last]
        with pytest.raises(tenantkv.SegmentIntegrityError) as info:
            stream.wait_for_layer(damaged)
        assert info.value.delivered_layers == 0  # layer `last` was handed, but not from 0
        # A failed stream hands out nothing more, not even an intact layer.
        with pytest.raises(tenantkv.LoadError):
            stream.wait_for_layer(0)
    assert_dropped(kv, victim)


def test_ocb3_suite_detects_a_flipped_bit(cache_root: Path) -> None:
    with tenantkv.open(cache_root, durable=False, suite="aes-256-ocb3") as kv:
        scene = make_scene(kv, cache_root, MLA_SMALL)
        assert scene.victim.extent.read_bytes()[5] == int(crypto.CipherSuite.AES_256_OCB3)
        delivered = flip_segment_byte("ciphertext-first")(scene)
        expect_integrity_failure(scene.victim, delivered)
        assert_dropped(kv, scene.victim)


def store_two_extents(
    kv: TenantKV, cache_root: Path, layout: KVLayout, tokens: list[int], seed: int
) -> tuple[Stored, Stored]:
    """Block 0 in one extent (a first store), blocks 1-2 in a second (a longer store)."""
    layers = list(random_layers(layout, len(tokens), seed=seed))
    head = [prefix_of(layer, 64) for layer in layers]
    first = store_prefix(kv, cache_root, "acme", layout, tokens[:64], seed=seed, layers=head)
    whole = store_prefix(
        kv,
        cache_root,
        "acme",
        layout,
        tokens,
        seed=seed,
        new_tokens=len(tokens) - 64,
        layers=layers,
    )
    assert whole.geometry.num_blocks == NUM_BLOCKS - 1
    assert [e[: len(first.expected[0])] for e in whole.expected] == first.expected
    return first, whole


@pytest.mark.parametrize("damaged", ["first", "second"])
def test_only_the_damaged_extent_is_dropped(kv: TenantKV, cache_root: Path, damaged: str) -> None:
    """A prefix spread over two extents: dropping one leaves the other, lookup gets shorter."""
    layout = MLA_SMALL
    tokens = random_tokens(NUM_TOKENS, seed=2)
    first, whole = store_two_extents(kv, cache_root, layout, tokens, seed=2)
    target = first if damaged == "first" else whole
    # Flip a byte of the middle layer of the target extent's first slot.
    offset = target.geometry.offset(layout.num_layers // 2, 0) + 7

    def change(data: bytearray) -> None:
        data[offset] ^= 0x80

    edit(target.extent, change)
    expect_integrity_failure(whole, layout.num_layers // 2)
    assert kv.security_events()[EVENT] == 1
    assert not target.extent.exists()
    if damaged == "first":
        assert first.ns.lookup(tokens) == 0  # block 0 is gone, so nothing after it counts
        assert whole.extent.exists()
    else:
        assert first.ns.lookup(tokens) == 64
        assert first.extent.exists()
        assert load_bytes(first.ns, tokens[:64]) == first.expected
    assert kv.recent_security_events()[-1].tenant == "acme"


RECOVERY_ATTACKS = [
    "flip-tag-first",
    "truncate-half",
    "swap-blocks-same-layer",
    "replace-with-other-tenants-extent",
    "header-byte-0",
    "delete",
]


@pytest.mark.parametrize("attack_name", RECOVERY_ATTACKS)
def test_storing_again_after_a_failure_recovers(
    kv: TenantKV, cache_root: Path, attack_name: str
) -> None:
    scene = make_scene(kv, cache_root, MLA_SMALL)
    victim = scene.victim
    expect_failure(kv, attack_name, victim, ATTACKS[attack_name](scene))
    events = kv.security_events().get(EVENT, 0)
    # The owner stores the same prefix again: it is stored anew and loads exactly.
    again = store_prefix(kv, cache_root, "acme", MLA_SMALL, victim.tokens, seed=1)
    assert again.extent != victim.extent
    assert again.expected == victim.expected
    assert load_bytes(again.ns, victim.tokens) == victim.expected
    assert kv.security_events().get(EVENT, 0) == events  # the recovery raised nothing new


def test_recovery_when_the_first_of_two_extents_was_dropped(kv: TenantKV, cache_root: Path) -> None:
    """Blocks 1-2 survive in their extent; storing again only re-seals block 0."""
    layout = MLA_SMALL
    tokens = random_tokens(NUM_TOKENS, seed=3)
    first, whole = store_two_extents(kv, cache_root, layout, tokens, seed=3)
    first.extent.unlink()
    expect_lost(whole)  # the first extent's bytes are gone: a miss, not an attack
    assert whole.ns.lookup(tokens) == 0
    assert whole.extent.exists()
    assert kv.health_counters()["lost_extents"] == 1
    again = store_prefix(kv, cache_root, "acme", layout, tokens, seed=3, new_tokens=64)
    assert again.geometry.num_blocks == 1
    assert whole.ns.lookup(tokens) == NUM_TOKENS
    assert load_bytes(whole.ns, tokens) == whole.expected
    assert kv.security_events().get(EVENT, 0) == 0


# ---- the index's rows, edited by an operator with database access -----------------------------


def _edit_rows(scene: Scene, attack: str) -> None:
    """Change the victim's rows in the index the way a database operator could (no key needed)."""
    victim_id, index = scene.victim.extent.stem, scene.kv.context.index
    other_id = (
        scene.other_tenant().extent.stem if attack == "blocks-to-other-tenants-extent" else ""
    )
    with index.write() as session:
        blocks = session.scalars(
            select(Block).where(Block.extent_id == victim_id).order_by(Block.slot)
        ).all()
        assert len(blocks) == NUM_BLOCKS
        extent = session.get(Extent, victim_id)
        assert extent is not None
        if attack == "swap-block-slots":
            blocks[0].slot, blocks[1].slot = blocks[1].slot, blocks[0].slot
        elif attack == "edit-extent-salt":
            extent.salt = bytes(b ^ 0x01 for b in extent.salt)
        elif attack == "blocks-to-other-tenants-extent":
            for block in blocks:
                block.extent_id = other_id
        else:  # "extent-key-version": a version the tenant never had
            extent.key_version += 1


@pytest.mark.parametrize(
    "attack",
    [
        "swap-block-slots",
        "edit-extent-salt",
        "blocks-to-other-tenants-extent",
        "extent-key-version",
    ],
)
def test_edited_index_rows_never_return_wrong_data(
    kv: TenantKV, cache_root: Path, attack: str
) -> None:
    """Rows pointing at other bytes or keys fail to open (a security event, the extent dropped);
    rows the load plan or key lookup cannot follow are a miss. The owner's exact load before the
    edit (in make_scene) is the positive control."""
    scene = make_scene(kv, cache_root, MLA_SMALL)
    _edit_rows(scene, attack)
    if attack in ("swap-block-slots", "edit-extent-salt"):
        expect_integrity_failure(scene.victim, 0)
        assert_dropped(kv, scene.victim)
    else:
        expect_lost(scene.victim)
        assert kv.security_events().get(EVENT, 0) == 0
    if scene.bystander is not None:  # the tenant whose extent the rows named keeps its data
        assert load_bytes(scene.bystander.ns, scene.bystander.tokens) == scene.bystander.expected
