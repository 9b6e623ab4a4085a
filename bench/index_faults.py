#!/usr/bin/env python3
"""Index faults (issue 33): a worker node behind a faulty network, a checker node beside it.

A worker node reaches the PostgreSQL index through a TCP proxy (``tests/tcp_proxy.py``) that,
``--faults`` times at random moments, cuts every connection (reset), refuses new ones, or holds
them silent (connected, nothing answers), each for 0.5-5 s, plus one long stall
(``--long-stall`` s). Meanwhile ``--threads`` threads of the worker look up, store and load
prefixes of two tenants, and one calls maintenance (``gc``, ``rotate_keys``, ``info``,
``list_tenants``); a second node, connected directly, loads every prefix the worker stored and
checks it byte for byte. Reported: operations by outcome (inside and outside faults), the
longest call during a fault against its bound (``index_serving_timeout`` for the serving calls,
``index_admin_timeout`` for maintenance), wrong bytes, cross-tenant hits, untyped errors (any
exception not a ``TenantKVError``), and recovery: seconds from healing to the worker's first
hit on a stored prefix. Targets: 0 wrong, 0 cross-tenant, 0 untyped, no call over its bound
plus 0.5 s, recovery within 2 s.

Output: fixed-width tables, ``bench/results/index_faults.png`` (call times during faults by
operation; recovery times) and ``index_faults.json`` (``--out DIR``).

Run:  .venv/bin/python bench/index_faults.py [--faults 150] [--long-stall 30] [--threads 4]
      [--serving-timeout 2] [--admin-timeout 30] [--postgres URL]
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _cli import add_postgres, bench_parser, write_outputs
from _common import format_stats_table, print_machine
from _fixtures import lookup_layout, open_cache, postgres_schema, random_layers, same_bits
from _plots import median_bars, pyplot, save_figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tcp_proxy import TcpProxy  # the proxy the outage tests use

TENANTS = ("acme", "beta")
TOKENS = 128  # two 64-token blocks per prefix
PREFIXES = 24  # per tenant
SERVING_OPS = ("lookup", "store", "load")
ADMIN_OPS = ("gc", "rotate_keys", "info", "list_tenants")
KINDS = ("cut", "refuse", "stall")


@dataclass
class Tally:
    """What the campaign saw; every field is guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # op, phase, result
    during: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    over: list[tuple[str, float]] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    checked_loads: int = 0
    cross_tenant: int = 0
    recovery: list[float] = field(default_factory=list)
    stored: set[tuple[str, int]] = field(default_factory=set)


class Faults:
    """The fault now in force (None: healthy)."""

    def __init__(self) -> None:
        self.kind: str | None = None


def _prefix(tenant: str, index: int) -> tuple[list[int], list[Any]]:
    seed = (TENANTS.index(tenant) + 1) * 1000 + index
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(TOKENS)]
    return tokens, random_layers(lookup_layout(), TOKENS, seed)


def _load_layers(ns: Any, tokens: list[int]) -> list[Any]:
    with ns.load(tokens) as stream:
        return [layer for _, layer in stream]


def _record(
    tally: Tally, tenantkv: Any, op: str, bound: float, faults: Faults, call: Any, *args: Any
) -> Any:
    """Run one call; file its outcome, and its time when a fault was in force."""
    phase = "fault" if faults.kind else "healthy"
    started = time.monotonic()
    result: Any = None
    try:
        result = call(*args)
        outcome = "ok"
    except tenantkv.TenantKVError as err:
        outcome = type(err).__name__
    except Exception as err:  # an untyped error: what the campaign counts
        outcome = "UNTYPED"
        with tally.lock:
            tally.untyped.append(f"{op}: {err!r}"[:300])
    seconds = time.monotonic() - started
    with tally.lock:
        tally.outcomes[(op, phase, outcome)] += 1
        if phase == "fault" or faults.kind:
            tally.during[op].append(seconds)
            if seconds > bound + 0.5:
                tally.over.append((op, seconds))
    return result if outcome == "ok" else None


def _serving_loop(
    tenantkv: Any, node: Any, tally: Tally, faults: Faults, stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    layout = lookup_layout()
    spaces = {t: node.namespace(t, model="faults", layout=layout) for t in TENANTS}
    bound = node.config.index_serving_timeout
    while not stop.is_set():
        tenant = rng.choice(TENANTS)
        other = TENANTS[1 - TENANTS.index(tenant)]
        index = rng.randrange(PREFIXES)
        tokens, layers = _prefix(tenant, index)
        ns = spaces[tenant]
        op = rng.choice(SERVING_OPS)
        if op == "store":
            stored = _record(tally, tenantkv, op, bound, faults, ns.store, tokens, layers)
            if stored:
                with tally.lock:
                    tally.stored.add((tenant, index))
        elif op == "lookup":
            _record(tally, tenantkv, op, bound, faults, ns.lookup, tokens)
            # the other tenant's prefix, looked up here, must never hit
            theirs, _ = _prefix(other, index)
            if _record(tally, tenantkv, op, bound, faults, ns.lookup, theirs):
                with tally.lock:
                    tally.cross_tenant += 1
        else:
            got = _record(tally, tenantkv, op, bound, faults, _load_layers, ns, tokens)
            if got is not None:
                wrong = sum(not same_bits(a, b) for a, b in zip(got, layers, strict=True))
                with tally.lock:
                    tally.checked_loads += 1
                    tally.wrong_bytes += wrong * layers[0].numel() * layers[0].element_size()


def _admin_loop(
    tenantkv: Any, node: Any, tally: Tally, faults: Faults, stop: threading.Event
) -> None:
    bound = node.config.index_admin_timeout
    calls = {
        "gc": node.gc,
        "rotate_keys": lambda: node.rotate_keys("beta"),
        "info": node.info,
        "list_tenants": node.list_tenants,
    }
    while not stop.is_set():
        for op, call in calls.items():
            _record(tally, tenantkv, op, bound, faults, call)
            stop.wait(0.5)


def _checker_loop(checker: Any, tally: Tally, stop: threading.Event) -> None:
    """Load every prefix the worker stored, directly, and compare it byte for byte."""
    layout = lookup_layout()
    spaces = {t: checker.namespace(t, model="faults", layout=layout) for t in TENANTS}
    while not stop.is_set():
        with tally.lock:
            stored = sorted(tally.stored)
        for tenant, index in stored:
            tokens, layers = _prefix(tenant, index)
            try:
                with spaces[tenant].load(tokens) as stream:
                    got = [layer for _, layer in stream]
            except Exception:  # evicted or expired meanwhile: not a wrong byte
                continue
            wrong = sum(not same_bits(a, b) for a, b in zip(got, layers, strict=True))
            with tally.lock:
                tally.checked_loads += 1
                tally.wrong_bytes += wrong * layers[0].numel() * layers[0].element_size()
        stop.wait(0.5)


def _recovered_in(worker: Any, tally: Tally, limit: float = 60.0) -> float:
    """Seconds from now until the worker hits a prefix it is known to hold."""
    layout = lookup_layout()
    with tally.lock:
        known = sorted(tally.stored)
    started = time.monotonic()
    if not known:
        return 0.0
    tenant, index = known[0]
    tokens, _ = _prefix(tenant, index)
    while time.monotonic() - started < limit:
        try:
            space = worker.namespace(tenant, model="faults", layout=layout)
            if space.lookup(tokens) == TOKENS:
                return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.02)
    return float("inf")


def run(args: Any) -> dict[str, Any]:
    import tenantkv

    rng = random.Random(args.seed)
    tally = Tally()
    faults = Faults()
    stop = threading.Event()
    schedule = [(rng.choice(KINDS), rng.uniform(0.5, 5.0)) for _ in range(args.faults)]
    schedule.insert(rng.randrange(len(schedule) + 1), ("stall", args.long_stall))
    with postgres_schema(args.postgres) as url, tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        from sqlalchemy import make_url

        server = make_url(url)
        proxy = TcpProxy((server.host or "127.0.0.1", server.port or 5432))
        proxy.start()
        proxied = server.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
        root = Path(tmp) / "cache"
        checker = open_cache(root, url, durable=False)
        worker = open_cache(
            root,
            proxied,
            durable=False,
            index_serving_timeout=args.serving_timeout,
            index_admin_timeout=args.admin_timeout,
            lease_seconds=6.0,
        )
        try:
            for tenant in TENANTS:
                checker.create_tenant(tenant, quota_bytes=2**30)
            threads = [
                threading.Thread(
                    target=_serving_loop, args=(tenantkv, worker, tally, faults, stop, i)
                )
                for i in range(args.threads)
            ]
            threads.append(
                threading.Thread(target=_admin_loop, args=(tenantkv, worker, tally, faults, stop))
            )
            threads.append(threading.Thread(target=_checker_loop, args=(checker, tally, stop)))
            for thread in threads:
                thread.start()
            time.sleep(3.0)  # something is stored before the first fault
            for number, (kind, seconds) in enumerate(schedule, 1):
                faults.kind = kind
                getattr(proxy, kind)()
                time.sleep(seconds)
                proxy.heal()
                faults.kind = None
                recovered = _recovered_in(worker, tally)
                with tally.lock:
                    tally.recovery.append(recovered)
                print(
                    f"fault {number}/{len(schedule)}: {kind} {seconds:.1f} s, "
                    f"recovered in {recovered:.2f} s",
                    flush=True,
                )
                time.sleep(rng.uniform(1.0, 3.0))
            stop.set()
            for thread in threads:
                thread.join()
        finally:
            proxy.heal()
            worker.close()
            checker.close()
            proxy.stop()
    return {
        "faults": [{"kind": k, "seconds": s} for k, s in schedule],
        "outcomes": [
            {"op": op, "phase": phase, "outcome": outcome, "count": count}
            for (op, phase, outcome), count in sorted(tally.outcomes.items())
        ],
        "during": {op: values for op, values in tally.during.items()},
        "over_bound": tally.over,
        "untyped": tally.untyped,
        "wrong_bytes": tally.wrong_bytes,
        "checked_loads": tally.checked_loads,
        "cross_tenant": tally.cross_tenant,
        "recovery": tally.recovery,
        "serving_timeout": args.serving_timeout,
        "admin_timeout": args.admin_timeout,
    }


def report(data: dict[str, Any]) -> None:
    print("\nOperations by outcome (phase: a fault in force, or healthy)")
    print(f"{'operation':<14}{'phase':<9}{'outcome':<24}{'count':>8}")
    for row in data["outcomes"]:
        print(f"{row['op']:<14}{row['phase']:<9}{row['outcome']:<24}{row['count']:>8}")
    rows = [
        (op, values, f"bound {_bound(op, data):g} s")
        for op, values in sorted(data["during"].items())
        if values
    ]
    if rows:
        print("\nCall times during a fault\n" + format_stats_table(rows, "s", label="operation"))
    recovery = [r for r in data["recovery"] if r != float("inf")]
    if recovery:
        print("\n" + format_stats_table([("recovery", recovery, "heal to first hit")], "s"))
    longest = max((max(v) for v in data["during"].values() if v), default=0.0)
    print(
        f"\nfaults {len(data['faults'])}, checked loads {data['checked_loads']}, "
        f"wrong bytes {data['wrong_bytes']}, cross-tenant hits {data['cross_tenant']}, "
        f"untyped errors {len(data['untyped'])}, calls over bound + 0.5 s "
        f"{len(data['over_bound'])}, longest call during a fault {longest:.2f} s, "
        f"unrecovered {len(data['recovery']) - len(recovery)}"
    )
    for line in data["untyped"][:10]:
        print("  untyped:", line)


def _bound(op: str, data: dict[str, Any]) -> float:
    return data["serving_timeout"] if op in SERVING_OPS else data["admin_timeout"]


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ops = sorted(op for op, values in data["during"].items() if values)
    median_bars(left, range(len(ops)), [data["during"][op] for op in ops], color="tab:orange")
    for i, op in enumerate(ops):
        left.hlines(_bound(op, data) + 0.5, i - 0.4, i + 0.4, colors="red", linestyles="dashed")
    left.set_xticks(range(len(ops)), ops, rotation=30)
    left.set_ylabel("seconds (median, min-max; red: bound + 0.5 s)")
    left.set_title("call times during a fault")
    recovery = [min(r, 60.0) for r in data["recovery"]]
    right.plot(range(1, len(recovery) + 1), recovery, "o", markersize=3)
    right.axhline(2.0, color="red", linestyle="dashed")
    right.set_xlabel("fault")
    right.set_ylabel("seconds from heal to first hit")
    right.set_title("recovery")
    save_figure(fig, path)


def main() -> None:
    parser = bench_parser(__doc__, seed=33)
    add_postgres(parser, skip=None)
    parser.add_argument("--faults", type=int, default=150, help="random faults (150)")
    parser.add_argument("--long-stall", type=float, default=30.0, help="one long stall, s (30)")
    parser.add_argument("--threads", type=int, default=4, help="serving threads (4)")
    parser.add_argument("--serving-timeout", type=float, default=2.0)
    parser.add_argument("--admin-timeout", type=float, default=30.0)
    args = parser.parse_args()
    machine = print_machine(args.dir)
    data = run(args)
    report(data)
    write_outputs(args.out, "index_faults", {"machine": machine, **data}, lambda p: plot(data, p))


if __name__ == "__main__":
    main()
