"""The anchor file: signed checkpoints appended outside the database.

Signed checkpoints stored in the database can be deleted by anyone who can write to it, and a
chain head can be put back to an older state copied earlier (its MAC included). So the cache also
appends checkpoints to a file beside its master key (default ``<root>/audit-anchors.jsonl``, mode
0600), one export line per checkpoint, only for heads that have *committed*: after the periodic
audit maintenance, and when an export starts. The file is append-only by use; every line is signed,
so it can be checked like an export.

Reading it (:meth:`AnchorFile.latest`) yields the latest anchored checkpoint of each chain; the log
refuses to export or anchor a chain whose database state is behind it or disagrees with it. Lines
must verify under the log's current key: a line signed by another key means the signing-key row
was replaced; a line that does not verify means the file was edited. Both raise
:class:`AuditChainError`. An unterminated last line is a torn append (a crash mid-write) and is
ignored until completed; a file that is shorter than when last read was truncated.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from cryptography.exceptions import InvalidSignature

from .canonical import SIGNATURE_FIELD, split_sealed_line
from .errors import AuditChainError
from .records import Checkpoint
from .signing import Signer

ANCHOR_FILE_NAME = "audit-anchors.jsonl"


class AnchorFile:
    """Appends checkpoints to one file and remembers the latest per chain (read incrementally)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._offset = 0
        self._latest: dict[str, Checkpoint] = {}

    def append(self, checkpoints: list[Checkpoint]) -> None:
        """Append ``checkpoints`` durably (0600, fsync) in one write."""
        if not checkpoints:
            return
        data = "".join(c.to_jsonl() + "\n" for c in checkpoints).encode("utf-8")
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def latest(self, signer: Signer) -> dict[str, Checkpoint]:
        """The latest anchored checkpoint of each chain, every line checked against ``signer``."""
        with self._lock:
            try:
                with open(self.path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    if size < self._offset:
                        raise AuditChainError(
                            f"the audit anchor file {self.path} shrank from {self._offset} to "
                            f"{size} bytes (truncated)"
                        )
                    handle.seek(self._offset)
                    data = handle.read()
            except FileNotFoundError:
                if self._offset:
                    raise AuditChainError(
                        f"the audit anchor file {self.path} was removed"
                    ) from None
                return {}
            complete = data[: data.rfind(b"\n") + 1]
            for raw in complete.splitlines():
                checkpoint = self._parse(raw, signer)
                known = self._latest.get(checkpoint.chain)
                if known is None or (checkpoint.seq, checkpoint.time_us) >= (
                    known.seq,
                    known.time_us,
                ):
                    self._latest[checkpoint.chain] = checkpoint
            self._offset += len(complete)
            return dict(self._latest)

    def _parse(self, raw: bytes, signer: Signer) -> Checkpoint:
        where = f"audit anchor file {self.path}"
        sealed = split_sealed_line(raw.decode("utf-8", errors="replace"))
        if sealed is None or sealed[1] != SIGNATURE_FIELD:
            raise AuditChainError(f"{where}: a line is not a signed checkpoint (edited)")
        body_text, _, signature = sealed
        try:
            body = json.loads(body_text)
        except ValueError:
            raise AuditChainError(f"{where}: a line is not JSON (edited)") from None
        if not isinstance(body, dict) or body.get("type") != "checkpoint":
            raise AuditChainError(f"{where}: a line is not a checkpoint (edited)")
        if body.get("key_id") != signer.key_id:
            raise AuditChainError(
                f"{where}: a checkpoint names signing key {body.get('key_id')!r}, the database "
                f"holds {signer.key_id} (the signing-key row was replaced)"
            )
        try:
            signer.public_key.verify(bytes.fromhex(signature), body_text.encode("utf-8"))
        except (InvalidSignature, ValueError):
            raise AuditChainError(f"{where}: a checkpoint signature does not verify") from None
        return Checkpoint(
            chain=str(body["chain"]),
            seq=int(body["seq"]),
            head_hash=str(body["head_hash"]),
            count=int(body["count"]),
            time_us=int(body["time_us"]),
            key_id=str(body["key_id"]),
            signature=bytes.fromhex(signature),
        )
