"""The ``tenantkv`` command line: ``demo``, ``init``, ``info``, ``gc``, ``walkthrough``,
``audit``, ``db``, ``serve``, ``token``, ``whoami``, ``key``, ``config``, ``gateway``,
``conformance``, and the admin actions ``tenant``, ``usage``, ``purge``, ``datakey``,
``capacity`` and ``job`` (docs/cli.md).

A failure is one sentence on stderr and a non-zero exit (2: the request was refused; 1: it
failed); ``--debug`` shows the traceback instead. The parser and ``--help`` import neither
torch nor the cache's data path: commands import them when they open a cache.

Every command takes ``--config FILE`` (or ``TENANTKV_CONFIG``): the configuration file, checked
whole before the command runs, whose settings the environment overrides and the command's own
arguments override in turn. A ``TENANTKV_*`` variable no component reads stops every command
(``config.check_environment``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import check_environment, config_for_root, default_root
from ..errors import CacheNotFoundError, MasterKeyError, TenantExistsError, TenantKVError
from ..settings_file import CONFIG_ENV
from ..token_limits import BOOTSTRAP_TTL_SECONDS, MAX_TTL_SECONDS
from .admin import register as register_admin_commands
from .audit import register as register_audit_commands
from .config import register as register_config_commands
from .config import validate_file
from .conformance import register as register_conformance_command
from .db import register as register_db_commands
from .gateway import register as register_gateway_commands
from .jobs import add_job_options
from .jobs import register as register_job_commands
from .keys import register as register_key_commands
from .server import register as register_server_commands


def _print_table(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")


def _cmd_init(args: argparse.Namespace) -> int:
    """Create a cache, or check an existing one. The bootstrap operator token is shown only by
    the ``init`` that created the index (and only once per index even then), with an expiry:
    mint lasting credentials with it; ``tenantkv token recover`` replaces a lost one."""
    if not 0 < args.token_ttl <= MAX_TTL_SECONDS:
        print(
            f"tenantkv init: --token-ttl must be more than 0 and at most {int(MAX_TTL_SECONDS)}",
            file=sys.stderr,
        )
        return 2
    from .. import open as open_cache
    from ..services.opening import holds_cache

    config = config_for_root(args.root)
    created = not holds_cache(config)
    with open_cache(config) as kv:
        token = kv.tokens.ensure_first_operator(args.token_ttl) if created else None
        info = kv.info()
    print(f"tenantkv {__version__}: cache ready at {Path(info['root']).resolve()}")
    _print_table([(k, str(v)) for k, v in info.items()])
    if token is not None:
        hours = args.token_ttl / 3600
        print(
            f"\nfirst operator token (shown once, stored only as a hash, expires in "
            f"{hours:g} h; keep it safe):"
        )
        print(f"  {token}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .. import open as open_cache

    try:
        with open_cache(config_for_root(args.root), create=False) as kv:
            info = kv.info()
            info["tenant_names"] = [t.name for t in kv.list_tenants()]
    except CacheNotFoundError as err:
        print(f"tenantkv info: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"tenantkv {__version__}")
        _print_table([(k, str(v)) for k, v in info.items()])
    return 0


def _gb_per_s(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


def _cmd_walkthrough(args: argparse.Namespace) -> int:
    """Store, look up and load a DeepSeek-V3-shaped prefix for two tenants; check every claim."""
    scratch = args.root is None
    root = args.root or tempfile.mkdtemp(prefix="tenantkv-walkthrough-")
    try:
        return _walkthrough(root, args.tokens, args.layers)
    finally:
        if scratch:
            shutil.rmtree(root, ignore_errors=True)


def _walkthrough(root: str, num_tokens: int, num_layers: int) -> int:
    import torch  # the one command family here that makes tensors

    from .. import BLOCK_TOKENS, KVLayout
    from .. import open as open_cache

    layout = KVLayout.mla(num_layers, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128_000, (num_tokens,), generator=generator).tolist()
    layers = [
        torch.randn(num_tokens, layout.values_per_token, generator=generator).to(torch.bfloat16)
        for _ in range(layout.num_layers)
    ]
    prefix_bytes = (
        layout.num_layers * (num_tokens // BLOCK_TOKENS) * BLOCK_TOKENS * layout.token_bytes
    )
    print(f"tenantkv {__version__} walk-through in {root}")
    print(
        f"  prefix: {num_tokens} tokens x {layout.num_layers} layers x "
        f"{layout.token_bytes} B = {prefix_bytes / 2**20:.1f} MiB (MLA latent, bf16)"
    )
    failures = 0
    with open_cache(root) as kv:
        for name in ("acme", "globex"):
            with contextlib.suppress(TenantExistsError):  # a reused root keeps its tenants
                kv.create_tenant(name)
        acme = kv.namespace("acme", model="deepseek-v3", layout=layout)
        globex = kv.namespace("globex", model="deepseek-v3", layout=layout)

        started = time.perf_counter()
        stored = acme.store(tokens, layers)
        store_s = time.perf_counter() - started
        print(
            f"  1. acme stores the prefix: {stored} new tokens ({_gb_per_s(prefix_bytes, store_s)})"
        )

        hit = acme.lookup(tokens)
        print(f"  2. acme looks it up: {hit} tokens cached")
        started = time.perf_counter()
        exact = True
        with acme.load(tokens[:hit]) as stream:
            for index, layer in stream:
                assert isinstance(layer, torch.Tensor)
                exact &= torch.equal(layer, layers[index][:hit])
        load_s = time.perf_counter() - started
        print(
            f"  3. acme loads it layer by layer: {'exact' if exact else 'MISMATCH'} "
            f"({_gb_per_s(layout.num_layers * hit * layout.token_bytes, load_s)})"
        )
        failures += not exact

        diverged = tokens[: 3 * BLOCK_TOKENS + 10] + [7] * (num_tokens - 3 * BLOCK_TOKENS - 10)
        partial = acme.lookup(diverged)
        print(f"  4. a prompt diverging at token {3 * BLOCK_TOKENS + 10}: {partial} tokens hit")
        failures += partial != 3 * BLOCK_TOKENS

        other = globex.lookup(tokens)
        print(f"  5. globex looks up the same tokens: {other} tokens (isolated)")
        failures += other != 0

        on_disk = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
        print(f"  6. on disk: {on_disk / 2**20:.1f} MiB, sealed with {kv.config.suite.name}")
    print("walk-through " + ("passed" if failures == 0 else f"FAILED ({failures} checks)"))
    return 0 if failures == 0 else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    """The end-to-end demo (README's main job); needs the ``hf`` extra (transformers)."""
    try:
        from ..demo import run_demo
    except ImportError as err:
        print(f"tenantkv demo: {err}", file=sys.stderr)
        return 2
    if args.new_tokens < 1:
        print("tenantkv demo: --new-tokens must be at least 1", file=sys.stderr)
        return 2
    scratch = args.root is None
    root = Path(args.root or tempfile.mkdtemp(prefix="tenantkv-demo-"))
    started = time.perf_counter()
    try:
        report = run_demo(root, fast=args.fast, new_tokens=args.new_tokens, out=sys.stdout)
    except FileExistsError as err:
        print(f"tenantkv demo: {err}", file=sys.stderr)
        return 2
    finally:
        if scratch:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"({time.perf_counter() - started:.1f} s" + (")" if scratch else f"; cache kept in {root})")
    )
    return 0 if report.passed else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    """GC as a job (the kind ``POST /v1/gc`` starts): a progress bar while it runs here, or
    ``--detach`` for its id; the job row keeps its result and lets it be resumed."""
    from .jobs import run_job
    from .output import opened, operator

    params = {} if args.orphan_grace is None else {"orphan_grace": args.orphan_grace}
    try:
        with opened(args.root) as kv:
            info = kv.jobs.start("gc", None, params, by=operator())
            return run_job(kv, info, args, "gc", _gc_summary)
    except CacheNotFoundError as err:
        print(f"tenantkv gc: {err}", file=sys.stderr)
        return 1


def _gc_summary(result: dict[str, Any]) -> str:
    return (
        f"gc: {result['expired_extents']} expired extents "
        f"({result['expired_bytes'] / 2**20:.1f} MiB), {result['orphans_removed']} orphaned "
        f"files and {result['temporary_removed']} leftover temporary files removed"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tenantkv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tenantkv {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a failure (default: a sentence)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="end to end: two tenants, a transformers model, misses, hits, audit"
    )
    demo.add_argument(
        "root", nargs="?", default=None, help="new cache directory to keep (default: a temp dir)"
    )
    demo.add_argument("--fast", action="store_true", help="a smaller model and conversation")
    demo.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    demo.set_defaults(handler=_cmd_demo)

    init = commands.add_parser("init", help="create a cache directory (index, key file)")
    init.add_argument("root", nargs="?", default=default_root())
    init.add_argument(
        "--token-ttl",
        type=float,
        default=BOOTSTRAP_TTL_SECONDS,
        help="lifetime in seconds of the bootstrap operator token a new cache shows "
        f"(default {int(BOOTSTRAP_TTL_SECONDS)})",
    )
    init.set_defaults(handler=_cmd_init)

    info = commands.add_parser("info", help="show what a cache holds")
    info.add_argument("root", nargs="?", default=default_root())
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(handler=_cmd_info)

    gc = commands.add_parser("gc", help="remove expired extents and orphaned files")
    gc.add_argument("root", nargs="?", default=default_root())
    gc.add_argument(
        "--orphan-grace",
        type=float,
        default=None,
        help="spare unindexed files younger than this many seconds, a store may be in flight "
        "(default: the cache's orphan_grace, 600)",
    )
    add_job_options(gc)
    gc.set_defaults(handler=_cmd_gc)

    register_admin_commands(commands)
    register_job_commands(commands)
    register_audit_commands(commands)
    register_db_commands(commands)
    register_server_commands(commands)
    register_key_commands(commands)
    register_config_commands(commands)
    register_gateway_commands(commands)
    register_conformance_command(commands)

    walk = commands.add_parser("walkthrough", help="store, look up and load a sample prefix")
    walk.add_argument("root", nargs="?", default=None, help="cache directory (default: a temp dir)")
    walk.add_argument("--tokens", type=int, default=2048)
    walk.add_argument("--layers", type=int, default=61)
    walk.set_defaults(handler=_cmd_walkthrough)
    _add_config_option(parser)
    return parser


def _add_config_option(parser: argparse.ArgumentParser, top: bool = True) -> None:
    """``--config FILE`` on the command and every subcommand (``tenantkv info --config F`` and
    ``tenantkv --config F info`` alike); ``main`` reads it before the parser is built."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None if top else argparse.SUPPRESS,
        help=f"configuration file (default: ${CONFIG_ENV}; docs/deploy.md)",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                _add_config_option(sub, top=False)


def _config_file(argv: Sequence[str] | None) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    return known.config if known.config else None


def _sentence(err: BaseException) -> str:
    """One line about an unexpected failure: its type and first line (a driver's message can
    run to pages: the statement, the parameters)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command. The configuration file is put in ``TENANTKV_CONFIG`` for the command's
    run (restored after), before the parser is built, so that every default (the root) and
    every settings reader (the cache, the admin server) sees the same file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    before = os.environ.get(CONFIG_ENV)
    path = _config_file(argv)
    if path is not None:
        os.environ[CONFIG_ENV] = path
    try:
        try:
            check_environment(os.environ)
            path = os.environ.get(CONFIG_ENV) or None
            args = build_parser().parse_args(argv)
            if path is not None and args.command != "config":
                validate_file(path, os.environ)
            return int(args.handler(args))
        except (TenantKVError, MasterKeyError) as err:
            if debug:
                raise
            print(f"tenantkv: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("tenantkv: interrupted", file=sys.stderr)
            return 130
        except Exception as err:  # an operator gets a sentence; --debug the traceback
            if debug:
                raise
            print(
                f"tenantkv: {_sentence(err)} (run with --debug for the traceback)", file=sys.stderr
            )
            return 1
    finally:
        if before is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = before


if __name__ == "__main__":
    sys.exit(main())
