"""Offline verification of a JSON Lines export: needs the file and the public key, nothing else.

:func:`verify_export` streams the lines once, keeping only per-chain state, and checks:

* every line is a sealed line (``canonical.py``): a record whose SHA-256 over its body bytes equals
  its ``hash``, or a checkpoint / export trailer whose Ed25519 signature over its body bytes
  verifies under the given key (and names that key's id);
* per chain, seqs rise by exactly one and each ``prev_hash`` is the previous record's ``hash``; a
  chain starting at seq 1 must start from the genesis hash; one starting later must be explained:
  by a signed purge statement right before its first record naming that seq and ``prev_hash``
  (older records removed by retention), or by the export's ``since`` bound;
* every checkpoint sits right after the record it names and repeats that record's hash; stored
  checkpoints at one seq appear in (time, signature) order; the last line of each chain block
  is the export's own checkpoint (signed at the trailer's time), whose ``count`` equals the
  records in the block;
* chain blocks appear once each, in chain-id order, and the signed trailer -- the last line --
  lists exactly those blocks (seq, count, head hash, checkpoint lines), so dropping, adding or
  duplicating a block, a record or a checkpoint, cutting the file at either end, reordering
  lines, or editing any byte is reported;
* the records agree with the trailer's tenant and time range;
* (format 2) each export checkpoint's edges: the record it names before the block is the one
  the block's first record links to and is older than ``since`` (a ``since`` block that starts
  neither at seq 1 nor at a purge statement needs one); the record it names after the block
  links to the block's last record and is not older than ``until``; with none named, the block
  ends at the chain's head. Format 1 exports (older tenantkv, no edges) still verify as before,
  and ``VerifyReport.version`` says which format a file is.

It never raises on bad input: every failure is a problem in the report.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from .canonical import (
    EXPORT_FORMAT_VERSION,
    FORMAT_VERSION,
    GENESIS_HASH,
    HASH_FIELD,
    SIGNATURE_FIELD,
    legacy_text,
    sha256_hex,
    split_sealed_line,
)
from .errors import AuditVerificationError
from .events import is_chain_of
from .signing import key_id_of, public_raw_of

MAX_PROBLEMS = 200
_HEX64 = re.compile(r"[0-9a-f]{64}")
_RECORD_KEYS = frozenset(
    {
        "action",
        "actor",
        "chain",
        "details",
        "outcome",
        "prev_hash",
        "request_id",
        "role",
        "seq",
        "target",
        "tenant",
        "time_us",
        "type",
        "v",
    }
)
_CHECKPOINT_KEYS = frozenset(
    {"chain", "count", "head_hash", "key_id", "seq", "time_us", "type", "v"}
)
_EXPORT_CHECKPOINT_KEYS = _CHECKPOINT_KEYS | {"after", "before", "head_seq"}
_EDGE_KEYS = frozenset({"hash", "prev_hash", "seq", "time_us"})
_TRAILER_KEYS = frozenset(
    {"chains", "key_id", "since_us", "tenant", "time_us", "type", "until_us", "v"}
)
_TRAILER_CHAIN_KEYS = frozenset({"chain", "checkpoints", "count", "head_hash", "seq"})
_PURGE_KEYS = frozenset({"chain", "first_seq", "key_id", "prev_hash", "time_us", "type", "v"})


@dataclass(frozen=True)
class ChainSummary:
    """What a verified chain block held."""

    chain: str
    first_seq: int
    last_seq: int
    records: int
    head_hash: str
    checkpoints: int
    from_genesis: bool
    """True when the block starts at seq 1; otherwise its first ``prev_hash`` is an anchor
    (older records were purged or left out by ``since``) that an earlier export can confirm."""
    purged: bool = False
    """True when a signed purge statement says retention removed the records before it."""
    head_seq: int | None = None
    """Where the chain's head was when it was exported (None: a format 1 export)."""
    before_seq: int | None = None
    before_time_us: int | None = None
    """The record just before the block, which the export shows is older than its ``since``
    (None: the block starts at seq 1, after purged records, or the export has no ``since``)."""
    after_seq: int | None = None
    after_time_us: int | None = None
    """The record just after the block, which the export shows is not older than its
    ``until`` (None: the block ends at the chain's head)."""


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_export`; ``ok`` only when there is no problem at all."""

    ok: bool
    problems: list[str]
    records: int = 0
    chains: list[ChainSummary] = field(default_factory=list)
    key_id: str | None = None
    tenant: str | None = None
    exported_at: float | None = None
    version: int | None = None
    """The export's format: 2 proves each block's edges, 1 (older tenantkv) does not."""

    def raise_if_invalid(self) -> None:
        if not self.ok:
            raise AuditVerificationError(self.problems)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def _opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


@dataclass(frozen=True)
class _Edge:
    """A record an export checkpoint names just outside its block (``records.EdgeRecord``)."""

    seq: int
    hash: str
    prev_hash: str
    time_us: int


@dataclass(frozen=True)
class _Edges:
    before: _Edge | None
    after: _Edge | None
    head_seq: int


def _edge(value: Any) -> _Edge | None:
    """The edge record an export checkpoint names; raises ValueError when it is malformed."""
    if value is None:
        return None
    if not (
        isinstance(value, dict)
        and set(value) == _EDGE_KEYS
        and _is_int(value["seq"])
        and _is_int(value["time_us"])
        and _is_hex64(value["hash"])
        and _is_hex64(value["prev_hash"])
    ):
        raise ValueError("malformed edge record")
    return _Edge(value["seq"], value["hash"], value["prev_hash"], value["time_us"])


@dataclass(frozen=True)
class _Signed:
    """A checkpoint line of a block: when it was signed, its signature, count and line, and the
    edges when it is an export checkpoint (format 2)."""

    time_us: int
    signature: str
    count: int
    line: int
    edges: _Edges | None = None


@dataclass
class _Block:
    """A chain block in progress."""

    chain: str
    first_seq: int
    first_time_us: int
    first_prev_hash: str
    last_seq: int
    last_hash: str
    last_time_us: int
    from_genesis: bool
    purged: bool = False
    records: int = 1
    checkpoints: int = 0
    # checkpoints since the last record
    group: list[_Signed] = field(default_factory=list)


class _Verifier:
    def __init__(self, public_key: Ed25519PublicKey | None, key_id: str | None) -> None:
        self.public_key = public_key
        self.key_id = key_id
        self.problems: list[str] = []
        self.dropped = 0
        self.block: _Block | None = None
        self.finished: list[ChainSummary] = []
        self.seen: set[str] = set()
        self.trailer: dict[str, Any] | None = None
        self.records = 0
        self.lines = 0
        self.block_times: dict[str, tuple[int, int]] = {}
        self.final_times: dict[str, int] = {}
        self.final_edges: dict[str, _Edges | None] = {}
        # a purge statement waiting for its chain's first record: (chain, seq, prev_hash, line)
        self.pending_purge: tuple[str, int, str, int] | None = None

    # ---- reporting ----------------------------------------------------------------------------

    def problem(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(message)
        else:
            self.dropped += 1

    # ---- lines --------------------------------------------------------------------------------

    def line(self, number: int, raw: str | bytes) -> None:
        self.lines += 1
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                self.problem(f"line {number}: not valid UTF-8")
                return
        elif isinstance(raw, str):
            text = raw
        else:
            self.problem(f"line {number}: not text ({type(raw).__name__})")
            return
        if text.endswith("\n"):
            text = text[:-1]
        if not text:
            self.problem(f"line {number}: empty line (exports have none)")
            return
        if text.endswith("\r"):
            self.problem(f"line {number}: ends with a carriage return (line endings converted?)")
            return
        if self.trailer is not None:
            self.problem(f"line {number}: content after the export trailer")
            return
        sealed = split_sealed_line(text)
        if sealed is None:
            self.problem(f"line {number}: not a sealed tenantkv audit line (no hash or signature)")
            return
        body_text, seal_field, seal = sealed
        try:
            body = json.loads(body_text)
        except ValueError:
            self.problem(f"line {number}: body is not valid JSON")
            return
        if not isinstance(body, dict):
            self.problem(f"line {number}: body is not a JSON object")
            return
        kind = body.get("type")
        versions = (FORMAT_VERSION, EXPORT_FORMAT_VERSION)
        if body.get("v") not in (versions if kind in ("checkpoint", "export") else versions[:1]):
            self.problem(f"line {number}: unknown format version {body.get('v')!r}")
            return
        if kind != "record" and self.pending_purge is not None:
            self.problem(
                f"line {self.pending_purge[3]}: purge statement not followed by its chain's "
                "first record"
            )
            self.pending_purge = None
        if kind == "record" and seal_field == HASH_FIELD:
            self.record(number, body_text, body, seal)
        elif kind == "purge" and seal_field == SIGNATURE_FIELD:
            self.purge(number, body_text, body, seal)
        elif kind == "checkpoint" and seal_field == SIGNATURE_FIELD:
            self.checkpoint(number, body_text, body, seal)
        elif kind == "export" and seal_field == SIGNATURE_FIELD:
            self.export_trailer(number, body_text, body, seal)
        else:
            self.problem(f"line {number}: unknown line type {kind!r} sealed by {seal_field!r}")

    def signature_ok(self, number: int, what: str, body_text: str, body: Any, seal: str) -> bool:
        if body.get("key_id") != self.key_id:
            self.problem(
                f"line {number}: {what} names signing key {body.get('key_id')!r}, "
                f"not the given key {self.key_id}"
            )
            return False
        if len(seal) != 128 or self.public_key is None:
            self.problem(f"line {number}: {what} signature is malformed")
            return False
        signature = bytes.fromhex(seal)
        for text in (body_text, legacy_text(body_text)):
            if text is None:
                continue
            try:
                self.public_key.verify(signature, text.encode("utf-8"))
            except InvalidSignature:
                continue
            return True
        self.problem(f"line {number}: {what} signature does not verify (edited or forged)")
        return False

    # ---- records ------------------------------------------------------------------------------

    def record(self, number: int, body_text: str, body: dict[str, Any], claimed: str) -> None:
        if set(body) != _RECORD_KEYS or not (
            isinstance(body["chain"], str)
            and _is_int(body["seq"])
            and body["seq"] >= 1
            and _is_int(body["time_us"])
            and _is_hex64(body["prev_hash"])
            and isinstance(body["details"], dict)
            and all(isinstance(body[k], str) for k in ("action", "actor", "outcome", "role"))
            and isinstance(body["target"], str)
            and _opt_str(body["tenant"])
            and _opt_str(body["request_id"])
        ):
            self.problem(f"line {number}: record fields are missing, extra or of the wrong type")
            return
        if len(claimed) != 64:
            self.problem(f"line {number}: record hash is malformed")
            return
        self.records += 1
        chain, seq, prev_hash = body["chain"], body["seq"], body["prev_hash"]
        if not _hashes_to(body_text, claimed):
            self.problem(
                f"line {number}: {chain} seq {seq}: hash does not match the record (edited)"
            )
        if not is_chain_of(chain, body["tenant"]):
            self.problem(f"line {number}: record of tenant {body['tenant']!r} filed in {chain!r}")
        block = self.block
        purge, self.pending_purge = self.pending_purge, None
        if block is None or block.chain != chain:
            self.start_block(number, chain, seq, prev_hash, claimed, body["time_us"])
            if purge is not None and self.block is not None:
                self.block.purged = self.purge_matches(purge, chain, seq, prev_hash)
            return
        if purge is not None:
            self.problem(f"line {purge[3]}: purge statement inside the block of {chain}")
        if block.group:  # the checkpoints just before this record were interim ones
            self.check_group(block, block.group)
            block.group = []
        if seq != block.last_seq + 1:
            self.problem(
                f"line {number}: {chain} seq {seq} follows seq {block.last_seq} "
                "(records missing, duplicated or reordered)"
            )
        if prev_hash != block.last_hash:
            self.problem(
                f"line {number}: {chain} seq {seq}: prev_hash does not link to the record before"
            )
        block.last_seq, block.last_hash, block.last_time_us = seq, claimed, body["time_us"]
        block.records += 1

    def start_block(
        self, number: int, chain: str, seq: int, prev_hash: str, digest: str, time_us: int
    ) -> None:
        if self.block is not None:
            self.finish_block()
        if chain in self.seen:
            self.problem(f"line {number}: chain {chain} appears a second time (lines moved)")
        elif self.finished and chain < self.finished[-1].chain:
            self.problem(f"line {number}: chain {chain} is out of chain-id order (lines moved)")
        self.seen.add(chain)
        if seq == 1 and prev_hash != GENESIS_HASH:
            self.problem(f"line {number}: {chain} seq 1 does not start from the genesis hash")
        self.block = _Block(
            chain=chain,
            first_seq=seq,
            first_time_us=time_us,
            first_prev_hash=prev_hash,
            last_seq=seq,
            last_hash=digest,
            last_time_us=time_us,
            from_genesis=seq == 1,
        )

    # ---- purge statements ---------------------------------------------------------------------

    def purge(self, number: int, body_text: str, body: dict[str, Any], seal: str) -> None:
        if set(body) != _PURGE_KEYS or not (
            isinstance(body["chain"], str)
            and _is_int(body["first_seq"])
            and _is_int(body["time_us"])
            and _is_hex64(body["prev_hash"])
        ):
            self.problem(f"line {number}: purge statement fields are missing, extra or malformed")
            return
        if not self.signature_ok(number, "purge statement", body_text, body, seal):
            return
        if self.pending_purge is not None:
            self.problem(f"line {number}: two purge statements in a row")
        self.pending_purge = (body["chain"], body["first_seq"], body["prev_hash"], number)

    def purge_matches(
        self, purge: tuple[str, int, str, int], chain: str, seq: int, prev_hash: str
    ) -> bool:
        """Whether the purge statement before a block's first record explains where it starts."""
        if purge[:3] == (chain, seq, prev_hash):
            return True
        self.problem(
            f"line {purge[3]}: the purge statement of {purge[0]} (first kept seq {purge[1]}) "
            f"does not match the first record of {chain}, seq {seq} (records deleted?)"
        )
        return False

    # ---- checkpoints --------------------------------------------------------------------------

    def checkpoint(self, number: int, body_text: str, body: dict[str, Any], seal: str) -> None:
        exported = body["v"] == EXPORT_FORMAT_VERSION  # an export's own, with its edges
        if set(body) != (_EXPORT_CHECKPOINT_KEYS if exported else _CHECKPOINT_KEYS) or not (
            isinstance(body["chain"], str)
            and _is_int(body["seq"])
            and _is_int(body["count"])
            and _is_int(body["time_us"])
            and _is_hex64(body["head_hash"])
            and (not exported or _is_int(body["head_seq"]))
        ):
            self.problem(f"line {number}: checkpoint fields are missing, extra or malformed")
            return
        edges = None
        if exported:
            try:
                edges = _Edges(_edge(body["before"]), _edge(body["after"]), body["head_seq"])
            except ValueError:
                self.problem(f"line {number}: checkpoint edges are malformed")
                return
        self.signature_ok(number, "checkpoint", body_text, body, seal)
        block = self.block
        chain, seq = body["chain"], body["seq"]
        if block is None or block.chain != chain:
            self.problem(f"line {number}: checkpoint of {chain} is not after that chain's records")
            return
        if seq != block.last_seq or body["head_hash"] != block.last_hash:
            self.problem(
                f"line {number}: checkpoint of {chain} at seq {seq} does not match the record "
                f"before it (seq {block.last_seq}): records changed after it was signed"
            )
        block.checkpoints += 1
        block.group.append(_Signed(body["time_us"], seal, body["count"], number, edges))

    def check_group(self, block: _Block, interim: list[_Signed]) -> None:
        """Stored checkpoints at one seq must keep the exporter's (time, signature) order; an
        export's own checkpoint ends its block and is never one of them."""
        for signed in interim:
            if signed.edges is not None:
                self.problem(
                    f"line {signed.line}: an export checkpoint of {block.chain} inside its "
                    "block (lines moved)"
                )
        for before, after in itertools.pairwise(interim):
            if (after.time_us, after.signature) < (before.time_us, before.signature):
                self.problem(f"line {after.line}: checkpoints of {block.chain} are out of order")

    def check_edges(self, block: _Block, edges: _Edges) -> None:
        """The edges an export checkpoint names must adjoin its block (their times are checked
        against the trailer's bounds in :meth:`check_scope`)."""
        chain, before, after = block.chain, edges.before, edges.after
        if before is not None and (
            before.seq != block.first_seq - 1 or before.hash != block.first_prev_hash
        ):
            self.problem(
                f"{chain}: the record the export names before seq {block.first_seq} "
                f"(seq {before.seq}) is not the one its first record links to"
            )
        if edges.head_seq < block.last_seq:
            self.problem(f"{chain}: ends at seq {block.last_seq}, past its head {edges.head_seq}")
        if after is None:
            if block.last_seq != edges.head_seq:
                self.problem(
                    f"{chain}: ends at seq {block.last_seq} but its head is at seq "
                    f"{edges.head_seq}, and the export names no record after it (records "
                    "deleted at its end?)"
                )
        elif (
            after.seq != block.last_seq + 1
            or after.prev_hash != block.last_hash
            or after.seq > edges.head_seq
        ):
            self.problem(
                f"{chain}: the record the export names after seq {block.last_seq} "
                f"(seq {after.seq}) does not link to its last record"
            )

    def finish_block(self) -> None:
        block = self.block
        if block is None:
            return
        self.block = None
        if not block.group:
            self.problem(
                f"{block.chain}: no signed checkpoint after its last record, seq "
                f"{block.last_seq} (file cut short, or records added)"
            )
        else:
            final = block.group[-1]
            self.check_group(block, block.group[:-1])
            self.final_times[block.chain] = final.time_us
            self.final_edges[block.chain] = final.edges
            if final.edges is not None:
                self.check_edges(block, final.edges)
            final_count = final.count
            if final_count != block.records:
                self.problem(
                    f"{block.chain}: the export checkpoint covers {final_count} records, "
                    f"the file holds {block.records} (records missing or added)"
                )
        edges = self.final_edges.get(block.chain)
        before = None if edges is None else edges.before
        after = None if edges is None else edges.after
        self.finished.append(
            ChainSummary(
                chain=block.chain,
                first_seq=block.first_seq,
                last_seq=block.last_seq,
                records=block.records,
                head_hash=block.last_hash,
                checkpoints=block.checkpoints,
                from_genesis=block.from_genesis,
                purged=block.purged,
                head_seq=None if edges is None else edges.head_seq,
                before_seq=None if before is None else before.seq,
                before_time_us=None if before is None else before.time_us,
                after_seq=None if after is None else after.seq,
                after_time_us=None if after is None else after.time_us,
            )
        )
        self.block_times[block.chain] = (block.first_time_us, block.last_time_us)

    # ---- the trailer --------------------------------------------------------------------------

    def export_trailer(self, number: int, body_text: str, body: dict[str, Any], seal: str) -> None:
        self.finish_block()
        self.trailer = body
        if set(body) != _TRAILER_KEYS or not (
            isinstance(body["chains"], list)
            and _opt_str(body["tenant"])
            and _is_int(body["time_us"])
            and (body["since_us"] is None or _is_int(body["since_us"]))
            and (body["until_us"] is None or _is_int(body["until_us"]))
        ):
            self.problem(f"line {number}: export trailer fields are missing, extra or malformed")
            return
        self.signature_ok(number, "export trailer", body_text, body, seal)
        listed: list[tuple[Any, ...]] = []
        for entry in body["chains"]:
            if not isinstance(entry, dict) or set(entry) != _TRAILER_CHAIN_KEYS:
                self.problem(f"line {number}: export trailer lists a malformed chain entry")
                return
            listed.append(tuple(entry[k] for k in sorted(_TRAILER_CHAIN_KEYS)))
        found = [
            (s.chain, s.checkpoints, s.records, s.head_hash, s.last_seq) for s in self.finished
        ]
        if listed != found:
            listed_names = [entry[0] for entry in listed]
            found_names = [entry[0] for entry in found]
            if listed_names != found_names:
                self.problem(
                    f"the export trailer lists chains {listed_names}, the file holds "
                    f"{found_names} (chains dropped, added or moved)"
                )
            else:
                self.problem(
                    "the export trailer does not match the chain blocks (records or checkpoint "
                    "lines dropped or added)"
                )
        self.check_scope(body)

    def check_scope(self, body: dict[str, Any]) -> None:
        tenant, since_us, until_us = body["tenant"], body["since_us"], body["until_us"]
        for summary in self.finished:
            final_time = self.final_times.get(summary.chain)
            if final_time is not None and final_time != body["time_us"]:
                self.problem(
                    f"{summary.chain}: its last checkpoint is not the one signed for this export "
                    "(checkpoint lines moved)"
                )
            if tenant is not None and not is_chain_of(summary.chain, tenant):
                self.problem(f"chain {summary.chain} is in an export of tenant {tenant!r} only")
            if not summary.from_genesis and not summary.purged and since_us is None:
                self.problem(
                    f"{summary.chain}: starts at seq {summary.first_seq} without a signed purge "
                    "statement (its oldest records were deleted, not purged by retention)"
                )
            self.check_edge_times(summary, body["v"], since_us, until_us)
            first_time, last_time = self.block_times[summary.chain]
            if since_us is not None and first_time < since_us:
                self.problem(f"{summary.chain}: first record is before the export's since bound")
            if until_us is not None and last_time >= until_us:
                self.problem(f"{summary.chain}: last record is after the export's until bound")

    def check_edge_times(
        self, summary: ChainSummary, version: Any, since_us: int | None, until_us: int | None
    ) -> None:
        """A format 2 export proves each block's edges against its bounds; format 1 did not."""
        chain = summary.chain
        if summary.chain not in self.final_edges:
            return  # no export checkpoint at all: reported already
        if (self.final_edges[chain] is not None) != (version == EXPORT_FORMAT_VERSION):
            self.problem(f"{chain}: its export checkpoint is not of the trailer's format")
            return
        if version != EXPORT_FORMAT_VERSION:
            return
        if summary.before_time_us is not None and (
            since_us is None or summary.before_time_us >= since_us
        ):
            self.problem(
                f"{chain}: the record before seq {summary.first_seq} is not older than the "
                "export's since bound"
            )
        if (
            summary.before_seq is None
            and since_us is not None
            and not summary.from_genesis
            and not summary.purged
        ):
            self.problem(
                f"{chain}: starts at seq {summary.first_seq}, and nothing shows that the record "
                "before it is older than the export's since bound (records deleted at its start?)"
            )
        if summary.after_time_us is not None and (
            until_us is None or summary.after_time_us < until_us
        ):
            self.problem(
                f"{chain}: the record after seq {summary.last_seq} is inside the export's "
                "until bound"
            )

    def report(self) -> VerifyReport:
        if self.block is not None:
            self.finish_block()
        if self.lines == 0:
            self.problem("the export is empty")
        elif self.trailer is None:
            self.problem("no export trailer: the file is cut short or not a tenantkv JSONL export")
        if self.dropped:
            self.problems.append(f"... and {self.dropped} more problems")
        trailer = self.trailer if isinstance(self.trailer, dict) else {}
        tenant = trailer.get("tenant")
        exported = trailer.get("time_us")
        version = trailer.get("v")
        return VerifyReport(
            ok=not self.problems,
            problems=self.problems,
            records=self.records,
            chains=self.finished,
            key_id=self.key_id,
            tenant=tenant if isinstance(tenant, str) else None,
            exported_at=exported / 1_000_000 if isinstance(exported, int) else None,
            version=version if _is_int(version) else None,
        )


def _hashes_to(body_text: str, claimed: str) -> bool:
    """Whether the record body hashes to ``claimed`` (as written now, or by older tenantkv)."""
    if sha256_hex(body_text.encode("utf-8")) == claimed:
        return True
    legacy = legacy_text(body_text)
    return legacy is not None and sha256_hex(legacy.encode("utf-8")) == claimed


def _load_public_key(pem: bytes) -> Ed25519PublicKey | None:
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, Ed25519PublicKey) else None


def verify_export(lines: Iterable[str | bytes], public_key_pem: bytes) -> VerifyReport:
    """Check a JSONL export against the log's public key; never raises on bad input.

    ``lines`` are the export's lines as ``str`` or ``bytes``, with or without their ``\\n``
    (an open file, ``text.splitlines()``, or the generator from :meth:`AuditLog.export`).
    """
    public_key = _load_public_key(public_key_pem) if isinstance(public_key_pem, bytes) else None
    key_id = None if public_key is None else key_id_of(public_raw_of(public_key))
    verifier = _Verifier(public_key, key_id)
    if public_key is None:
        verifier.problem("the public key is not an Ed25519 public key in PEM form")
    number = 0
    try:
        for number, raw in enumerate(lines, start=1):
            try:
                verifier.line(number, raw)
            except Exception as err:  # a verifier must report, never crash, on hostile input
                verifier.problem(f"line {number}: cannot be checked ({type(err).__name__})")
    except Exception as err:
        verifier.problem(f"reading the export failed after line {number}: {err}")
    return verifier.report()
