"""``tenantkv conformance``: run the isolation suite (``tenantkv.conformance``) against a live
deployment and print its table; ``--json FILE`` writes the report; the exit status is 1 when
any case failed or was inconclusive, 2 when the suite could not run.

The keys are given as values or as ``@FILE`` (the key is the file's first line), so that they
need not appear in a process listing. With the deployment's configuration file (``--config``,
the one the gateway runs with), the command also makes the attacks only an operator can make:
the owner's real ``cache_salt`` and assertions for the owner signed as the gateway signs them
(replayed), by another key (forged) and for another audience; without it those cases are
SKIPPED and say why.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import config_for_root, default_root
from ..errors import InvalidRequestError, TenantKVError
from ..settings_file import CONFIG_ENV

if TYPE_CHECKING:  # the suite needs httpx (the gateway extra) only when it runs
    from ..conformance.suite import AttackMaterial


def _key(value: str) -> str:
    if value.startswith("@"):
        try:
            lines = Path(value[1:]).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise InvalidRequestError(
                f"cannot read the key file {value[1:]}: {err.strerror}"
            ) from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise InvalidRequestError(f"the key file {value[1:]} is empty")
        return key
    return value


def attack_material(owner_key: str) -> tuple[AttackMaterial | None, str | None]:
    """The attacks only the operator can make, from the configuration file ``TENANTKV_CONFIG``
    names (its ``[gateway]`` table and the cache it serves); (None, why) where there is none."""
    from ..conformance.suite import AttackMaterial

    path = os.environ.get(CONFIG_ENV)
    if not path:
        return None, "no --config: the owner's salt and assertion attacks were not made"
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from .. import open as open_cache
    from ..gateway.config_section import load_gateway_table
    from ..gateway.keyed import cache_salt
    from ..integrations.engine_identity import ASSERTION_PARAM
    from ..tenant_assertion import AssertionSigner

    table = load_gateway_table(path)
    if not (table.audience and table.secret_file and table.signing_key_file):
        return None, f"{path} has no [gateway] audience, secret_file and signing_key_file"
    with open_cache(config_for_root(default_root()), create=False) as kv:
        identity = kv.inference_keys.authenticate(owner_key)
    if identity is None:
        raise InvalidRequestError("the owner's key is not a valid inference key of this cache")
    secret = Path(table.secret_file).read_bytes().strip()
    gateway = AssertionSigner(Path(table.signing_key_file).read_bytes())
    rogue = AssertionSigner(Ed25519PrivateKey.generate())

    def sign(signer: AssertionSigner, audience: str) -> str:
        return signer.sign(
            identity.tenant,
            scope=identity.scope,
            audience=audience,
            ttl=300.0,
            incarnation=identity.incarnation,
        )

    assertions = {
        "replayed": sign(gateway, table.audience),
        "forged": sign(rogue, table.audience),
        "other-audience": sign(gateway, table.audience + "-elsewhere"),
    }
    material = AttackMaterial(
        owner_salt=cache_salt(secret, identity),
        assertions=assertions,
        assertion_param=ASSERTION_PARAM,
    )
    return material, None


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        import httpx

        from ..conformance.probe import Prober
        from ..conformance.suite import Plan, Suite, Target
    except ImportError as err:
        print(f"tenantkv conformance needs the gateway extra (httpx): {err}", file=sys.stderr)
        return 2
    if args.samples < 0 or args.prompt_chars < 1 or args.timing_chars < 1:
        raise InvalidRequestError("--samples must be >= 0 and the prompt lengths >= 1")
    target = Target(
        gateway=args.gateway,
        model=args.model,
        owner_key=_key(args.owner_key),
        other_tenant_key=_key(args.other_tenant_key),
        other_scope_key=_key(args.other_scope_key),
        other_model=args.other_model,
        backends=tuple(args.backend or ()),
    )
    material, missing = attack_material(target.owner_key)
    plan = Plan(
        samples=args.samples,
        prompt_chars=args.prompt_chars,
        timing_chars=args.timing_chars,
        entrypoints=tuple(dict.fromkeys(args.entrypoint or ENTRYPOINTS)),
        streams={"both": (False, True), "on": (True,), "off": (False,)}[args.streaming],
        attacks=args.attacks,
    )

    def progress(step: str) -> None:
        if args.verbose:
            print(f"... {step}", file=sys.stderr, flush=True)

    try:
        with httpx.Client(timeout=args.timeout, trust_env=False) as client:
            suite = Suite(Prober(client), target, plan, material, progress=progress)
            report = suite.run()
    except TenantKVError as err:
        print(f"tenantkv conformance: {err}", file=sys.stderr)
        return 2
    if missing:
        report.notes.append(missing)
    print(report.table())
    if args.json:
        Path(args.json).write_text(report.dumps() + "\n", encoding="utf-8")
    return 1 if report.failed else 0


#: The matrix's entrypoints (tenantkv.conformance.probe.ENTRYPOINTS, which needs httpx).
ENTRYPOINTS = ("completions", "chat")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``conformance`` to the CLI's subcommands."""
    cmd = commands.add_parser(
        "conformance",
        help="prove a deployment's isolation through its gateway (docs/gateway.md)",
    )
    cmd.add_argument("--gateway", required=True, help="the gateway's base URL")
    cmd.add_argument("--model", required=True, help="a model the gateway serves")
    for flag, who in (
        ("--owner-key", "tenant A, one scope (the owner of the prefixes)"),
        ("--other-tenant-key", "tenant B"),
        ("--other-scope-key", "tenant A, another scope"),
    ):
        cmd.add_argument(flag, required=True, help=f"inference key of {who}; @FILE reads it")
    cmd.add_argument("--other-model", default=None, help="a second model the gateway serves")
    cmd.add_argument(
        "--backend",
        action="append",
        default=None,
        help="a vllm serve URL (repeatable), for POST /reset_prefix_cache "
        "(VLLM_SERVER_DEV_MODE=1); without it the tenantkv tier is not separated",
    )
    cmd.add_argument(
        "--samples", type=int, default=20, help="per group of the timing audit (0: none)"
    )
    cmd.add_argument(
        "--entrypoint",
        action="append",
        choices=ENTRYPOINTS,
        default=None,
        help="limit the matrix to these entrypoints (repeatable; default: all)",
    )
    cmd.add_argument(
        "--streaming",
        choices=("both", "on", "off"),
        default="both",
        help="the matrix's streamed requests, unstreamed ones, or both (default)",
    )
    cmd.add_argument(
        "--attacks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="try the client-supplied salt and kv_transfer_params attacks (default: yes)",
    )
    cmd.add_argument("--prompt-chars", type=int, default=400, help="length of matrix prompts")
    cmd.add_argument("--timing-chars", type=int, default=1500, help="length of timed prompts")
    cmd.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    cmd.add_argument("--json", default=None, help="write the report there as JSON")
    cmd.add_argument("-v", "--verbose", action="store_true", help="print each step")
    cmd.set_defaults(handler=_cmd_conformance)
