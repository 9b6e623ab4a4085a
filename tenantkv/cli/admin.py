"""The admin actions on the host: ``tenant``, ``usage``, ``purge``, ``datakey`` and
``capacity``, on the same services as the admin API (the facade's tenant methods, ``kv.jobs``),
audited as the user running them (``cli:<user>``, operator).

Every command opens an existing cache only, prints a table (``--json``: JSON), and answers a
bad argument with one sentence and a non-zero exit. Retirement, purge and deletion run as jobs
(``tenantkv.cli.jobs``): a progress bar, or ``--detach``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError
from ..time_window import FORMS, iso, parse_instant
from .jobs import add_job_options, run_job
from .output import (
    add_json,
    add_root,
    fields,
    opened,
    operator,
    parse_size,
    print_json,
    size,
    table,
    when,
)

if TYPE_CHECKING:
    from ..services.tenants import TenantInfo


# ---- tenants --------------------------------------------------------------------------------


def _retention(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, duration = pair.partition("=")
        if not sep or not name or not duration:
            raise InvalidRequestError(f"--retention {pair!r} must be CLASS=DURATION (chat=7d)")
        out[name] = duration
    return out


def _tenant_fields(info: TenantInfo) -> list[tuple[str, Any]]:
    return [
        ("name", info.name),
        ("created", when(info.created_at)),
        ("key version", info.key_version),
        ("key versions", ", ".join(map(str, info.key_versions))),
        ("quota", f"{size(info.quota_bytes)} ({info.quota_bytes:,} B)"),
        ("used", f"{size(info.used_bytes)} ({info.used_bytes:,} B)"),
        ("retention", ", ".join(f"{k}={v:g}s" for k, v in sorted((info.retention or {}).items()))),
        ("incarnation", info.incarnation),
    ]


def _cmd_tenant_create(args: argparse.Namespace) -> int:
    quota = None if args.quota is None else parse_size(args.quota)
    with opened(args.root) as kv:
        info = kv.create_tenant(
            args.name, quota_bytes=quota, retention=_retention(args.retention), by=operator()
        )
    print_json(info) if args.json else fields(_tenant_fields(info))
    return 0


def _cmd_tenant_list(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        tenants = kv.list_tenants()
    if args.json:
        print_json(tenants)
        return 0
    table(
        f"{len(tenants)} tenant(s)",
        ["name", "created", "key version", "quota", "used", "used %"],
        [
            (
                t.name,
                when(t.created_at),
                t.key_version,
                size(t.quota_bytes),
                size(t.used_bytes),
                100.0 * t.used_bytes / t.quota_bytes if t.quota_bytes else "-",
            )
            for t in tenants
        ],
    )
    return 0


def _cmd_tenant_show(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        info = kv.get_tenant(args.name)
    print_json(info) if args.json else fields(_tenant_fields(info))
    return 0


def _cmd_tenant_update(args: argparse.Namespace) -> int:
    quota = None if args.quota is None else parse_size(args.quota)
    retention = _retention(args.retention)
    if quota is None and retention is None:
        raise InvalidRequestError("nothing to change: give --quota and/or --retention")
    with opened(args.root) as kv:
        info = kv.update_tenant(args.name, quota_bytes=quota, retention=retention, by=operator())
    print_json(info) if args.json else fields(_tenant_fields(info))
    return 0


def _cmd_tenant_delete(args: argparse.Namespace) -> int:
    if not args.yes:
        raise InvalidRequestError(
            f"deleting {args.name!r} destroys its keys and every cached byte of it; "
            "add --yes to confirm"
        )
    with opened(args.root) as kv:
        info = kv.jobs.start("tenant.delete", args.name, by=operator())
        return run_job(kv, info, args, f"deleting {args.name}")


# ---- usage ----------------------------------------------------------------------------------


def _cmd_usage(args: argparse.Namespace) -> int:
    now = time.time()  # the arguments are checked before the cache is opened (and torch is)
    since = None if args.since is None else parse_instant(args.since, now)
    until = None if args.until is None else parse_instant(args.until, now)
    with opened(args.root) as kv:
        if args.tenant is None:
            reports = kv.usage_of_all(since=since, until=until)
        else:
            reports = [kv.usage(args.tenant, since=since, until=until, scope=args.scope)]
    rows: list[dict[str, Any]] = [
        {
            "tenant": r.tenant,
            "scope": r.scope,
            "since": r.since,
            "until": r.until,
            **r.counters,
            "hit_ratio": r.hit_ratio,
            "cost_units": r.cost_units,
        }
        for r in reports
    ]
    if args.json:
        print_json(rows)
        return 0
    window = f"{iso(since) or 'the beginning'} to {iso(until) or 'now'}"
    table(
        f"usage from {window}",
        [
            "tenant",
            "hits",
            "misses",
            "hit ratio",
            "served",
            "served bytes",
            "stored",
            "stored bytes",
            "cost",
        ],
        [
            (
                r["tenant"],
                r["hit_tokens"],
                r["miss_tokens"],
                "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}%",
                r["served_tokens"],
                size(r["served_bytes"]),
                r["stored_tokens"],
                size(r["stored_bytes"]),
                r["cost_units"],
            )
            for r in rows
        ],
    )
    print("(hits, misses, served and stored in tokens; cost in units: a miss token is 1)")
    return 0


# ---- purge, data keys -----------------------------------------------------------------------


def _cmd_purge(args: argparse.Namespace) -> int:
    params = {} if args.scope is None else {"scope": args.scope}
    with opened(args.root) as kv:
        info = kv.jobs.start("purge", args.tenant, params, by=operator())
        return run_job(kv, info, args, f"purging {args.tenant}")


def _cmd_datakey_rotate(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        version = kv.rotate_keys(args.tenant, by=operator())
    if args.json:
        print_json({"tenant": args.tenant, "key_version": version})
    else:
        print(f"{args.tenant}: new writes use data-key version {version}")
    return 0


def _cmd_datakey_retire(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        info = kv.jobs.start("keys.retire", args.tenant, by=operator())
        return run_job(kv, info, args, f"re-sealing {args.tenant}")


# ---- capacity -------------------------------------------------------------------------------


def _capacity_rows(kv: Any) -> dict[str, Any]:
    tenants = kv.list_tenants()
    return {
        "capacity_bytes": kv.capacity_bytes,
        "allow_overcommit": kv.allow_overcommit,
        "quota_bytes_total": sum(t.quota_bytes for t in tenants),
        "used_bytes_total": sum(t.used_bytes for t in tenants),
        "tenants": len(tenants),
    }


def _print_capacity(values: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(values)
        return
    fields(
        [
            ("capacity", f"{size(values['capacity_bytes'])} ({values['capacity_bytes']:,} B)"),
            ("overcommit", "allowed" if values["allow_overcommit"] else "refused"),
            ("quotas (sum)", size(values["quota_bytes_total"])),
            ("used (sum)", size(values["used_bytes_total"])),
            ("tenants", values["tenants"]),
        ]
    )


def _cmd_capacity_show(args: argparse.Namespace) -> int:
    with opened(args.root) as kv:
        _print_capacity(_capacity_rows(kv), args.json)
    return 0


def _cmd_capacity_set(args: argparse.Namespace) -> int:
    capacity = None if args.bytes is None else parse_size(args.bytes)
    if capacity is None and args.overcommit is None:
        raise InvalidRequestError(
            "nothing to change: give --bytes and/or --overcommit/--no-overcommit"
        )
    with opened(args.root) as kv:
        kv.set_capacity(capacity_bytes=capacity, allow_overcommit=args.overcommit, by=operator())
        _print_capacity(_capacity_rows(kv), args.json)
    return 0


# ---- the parser -----------------------------------------------------------------------------


def _sub(actions: Any, name: str, text: str, handler: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(name, help=text, description=text)
    parser.set_defaults(handler=handler)
    return parser


def register(commands: Any) -> None:
    """Add ``tenant``, ``usage``, ``purge``, ``datakey`` and ``capacity``."""
    tenant = commands.add_parser("tenant", help="create, list, show, update and delete tenants")
    actions = tenant.add_subparsers(dest="tenant_command", required=True)
    create = _sub(actions, "create", "create a tenant with a fresh data key", _cmd_tenant_create)
    create.add_argument("name")
    update = _sub(actions, "update", "change a tenant's quota and/or retention", _cmd_tenant_update)
    update.add_argument("name")
    for parser in (create, update):
        add_root(parser)
        parser.add_argument("--quota", help="bytes, or with a unit: 10GiB, 500MB")
        parser.add_argument(
            "--retention",
            action="append",
            metavar="CLASS=DURATION",
            help="how long a class of prefixes stays (chat=7d); repeat for several",
        )
        add_json(parser)
    listing = _sub(actions, "list", "every tenant with its quota and use", _cmd_tenant_list)
    add_root(listing)
    add_json(listing)
    show = _sub(actions, "show", "one tenant in full", _cmd_tenant_show)
    show.add_argument("name")
    add_root(show)
    add_json(show)
    delete = _sub(
        actions,
        "delete",
        "crypto-shred a tenant (keys, index rows, bytes), as a job",
        _cmd_tenant_delete,
    )
    delete.add_argument("name")
    add_root(delete)
    delete.add_argument("--yes", action="store_true", help="confirm: this cannot be undone")
    add_job_options(delete)

    usage = commands.add_parser(
        "usage", help="every tenant's hits, misses, hit ratio, tokens served and cost over a window"
    )
    add_root(usage)
    for flag in ("--since", "--until"):
        usage.add_argument(flag, default=None, help=FORMS)
    usage.add_argument("--tenant", default=None, help="one tenant only")
    usage.add_argument("--scope", default=None, help="one scope of --tenant only")
    add_json(usage)
    usage.set_defaults(handler=_cmd_usage)

    purge = commands.add_parser(
        "purge", help="drop a tenant's cached prefixes (keeps the tenant and keys), as a job"
    )
    purge.add_argument("tenant")
    add_root(purge)
    purge.add_argument("--scope", default=None, help='one scope only ("" = tenant-wide scope)')
    add_job_options(purge)
    purge.set_defaults(handler=_cmd_purge)

    datakey = commands.add_parser(
        "datakey", help="rotate and retire a tenant's data keys (encryption at rest)"
    )
    key_actions = datakey.add_subparsers(dest="datakey_command", required=True)
    rotate = _sub(key_actions, "rotate", "new writes use a new key version", _cmd_datakey_rotate)
    rotate.add_argument("tenant")
    add_root(rotate)
    add_json(rotate)
    retire = _sub(
        key_actions,
        "retire",
        "re-seal old-key extents, destroy old versions (a job)",
        _cmd_datakey_retire,
    )
    retire.add_argument("tenant")
    add_root(retire)
    add_job_options(retire)

    capacity = commands.add_parser("capacity", help="the store's capacity and overcommit policy")
    cap_actions = capacity.add_subparsers(dest="capacity_command", required=True)
    show_cap = _sub(
        cap_actions, "show", "capacity, overcommit and the sum of quotas", _cmd_capacity_show
    )
    add_root(show_cap)
    add_json(show_cap)
    set_cap = _sub(
        cap_actions, "set", "change the capacity and/or overcommit (audited)", _cmd_capacity_set
    )
    add_root(set_cap)
    set_cap.add_argument("--bytes", default=None, help="the new capacity: 4TiB, 500GB, bytes")
    set_cap.add_argument(
        "--overcommit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow quotas to add up to more than the capacity (weakens isolation)",
    )
    add_json(set_cap)
