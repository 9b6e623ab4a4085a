"""``tenantkv audit``: export the audit log, verify an export offline, print the public key.

``register(commands)`` adds the ``audit`` command group to the main CLI's subparsers; every
handler returns an exit status (0 ok, 1 an export that failed verification, 2 an error) and
reports its own errors, so it needs nothing from ``cli.main`` but ``args.handler(args)``.

``audit verify`` needs neither the cache nor the master key: the export file and the public key
(from ``audit public-key``) are enough, which is the point of a third-party check.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import getpass
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from ..audit import (
    EXPORT_FORMATS,
    ROLE_OPERATOR,
    Attribution,
    AuditError,
    ChainSummary,
    verify_export,
)
from ..config import config_for_root, default_root
from ..crypto import MasterKeyError
from ..errors import CacheNotFoundError


def parse_time(text: str) -> float:
    """Seconds since the epoch from ``1735689600[.5]`` or ISO 8601 (naive means UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither epoch seconds nor an ISO 8601 time"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name for this uid (containers)
        return f"cli:uid-{os.getuid()}"


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[IO[str]]:
    """stdout; a private temp file renamed onto ``path`` only once it is complete, when
    ``path`` is a regular file or does not exist yet (through a symbolic link: onto the file
    it names, so the link stays); or else ``path`` itself, written in place.

    Renaming onto a device, a FIFO or a socket would replace it with a regular file: run as
    root, ``--output /dev/null`` used to leave a 0600 file where ``/dev/null`` was, and every
    other program on the machine that opened it failed from then on.
    """
    if path is None or path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    target = Path(path)
    if target.exists() and not target.is_file():  # is_file() follows symbolic links
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "the output is a directory", path)
        with open(target, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
        return
    target = target.resolve() if target.is_symlink() else target
    fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _write_lines(lines: Iterable[str], out: IO[str]) -> int:
    count = 0
    for line in lines:
        out.write(line)
        out.write("\n")
        count += 1
    return count


def _cmd_export(args: argparse.Namespace) -> int:
    from .. import open as open_cache  # late: keeps `audit verify` free of the cache

    if args.since is not None and args.until is not None and args.since >= args.until:
        print("tenantkv audit: --since must be before --until", file=sys.stderr)
        return 2
    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            kv.audit.record_export(  # the export is itself audited, before it runs
                Attribution(_actor(), ROLE_OPERATOR),
                tenant=args.tenant,
                target=args.output or "-",
                details={
                    "format": args.format,
                    "since": args.since,
                    "until": args.until,
                    "tenant": args.tenant,
                },
            )
            lines = kv.audit.export(
                tenant=args.tenant, since=args.since, until=args.until, fmt=args.format
            )
            with _output(args.output) as out:
                count = _write_lines(lines, out)
    except (AuditError, MasterKeyError, CacheNotFoundError, OSError) as err:
        print(f"tenantkv audit: {err}", file=sys.stderr)
        return 2
    if args.output not in (None, "-"):
        print(f"wrote {count} lines to {args.output}", file=sys.stderr)
    return 0


def _cmd_public_key(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            pem = kv.audit.public_key_pem(create=True)  # creates the key on first use
    except (AuditError, MasterKeyError, CacheNotFoundError, OSError) as err:
        print(f"tenantkv audit: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(pem.decode("ascii"))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        public_key = Path(args.public_key).read_bytes()
        with open(args.file, "rb") as handle:
            report = verify_export(handle, public_key)
    except OSError as err:
        print(f"tenantkv audit: {err}", file=sys.stderr)
        return 2
    if report.ok:
        chains = ", ".join(
            f"{c.chain} seq {c.first_seq}..{c.last_seq}{_start_of(c)}" for c in report.chains
        )
        print(
            f"OK: {report.records} records in {len(report.chains)} chains, "
            f"signed by key {report.key_id}" + (f": {chains}" if chains else "")
        )
        if report.version == 1 and report.chains:
            print("  (format 1, an older tenantkv's: where its chains start and end is unproven)")
        return 0
    print(f"INVALID: {args.file} failed verification ({len(report.problems)} problems)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1


def _start_of(chain: ChainSummary) -> str:
    """Why a verified chain block starts where it does, when that is not seq 1."""
    if chain.from_genesis:
        return ""
    if chain.purged:
        return " (starts after records purged by retention)"
    if chain.before_seq is not None and chain.before_time_us is not None:
        moment = datetime.fromtimestamp(chain.before_time_us / 1_000_000, UTC)
        return (
            f" (starts at the since bound; the record before it (seq {chain.before_seq}, at "
            f"{moment.isoformat(timespec='seconds').replace('+00:00', 'Z')}) is older than since)"
        )
    return " (starts at the since bound)"


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``audit export|verify|public-key`` to the CLI's subcommands."""
    audit = commands.add_parser("audit", help="export and verify the tamper-evident audit log")
    actions = audit.add_subparsers(dest="audit_command", required=True)

    export = actions.add_parser("export", help="stream the audit log (JSONL, CEF or OCSF)")
    export.add_argument("root", nargs="?", default=default_root())
    export.add_argument("--tenant", default=None, help="one tenant's chain (default: all chains)")
    export.add_argument("--since", type=parse_time, default=None, help="ISO 8601 or epoch s")
    export.add_argument("--until", type=parse_time, default=None, help="ISO 8601 or epoch s")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
    export.add_argument("--output", default=None, help="file to write (default: stdout)")
    export.set_defaults(handler=_cmd_export)

    verify = actions.add_parser("verify", help="check a JSONL export offline")
    verify.add_argument("file")
    verify.add_argument("--public-key", required=True, help="PEM from `audit public-key`")
    verify.set_defaults(handler=_cmd_verify)

    public_key = actions.add_parser("public-key", help="print the checkpoint verification key")
    public_key.add_argument("root", nargs="?", default=default_root())
    public_key.set_defaults(handler=_cmd_public_key)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``audit`` commands on their own (``python -m tenantkv.cli.audit audit ...``)."""
    parser = argparse.ArgumentParser(prog="tenantkv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
