"""A second cache node for the fleet tests, run as its own process on the same root.

``python -m tests.fleet_node ROOT DATABASE_URL SEED NUM_TOKENS``: opens the cache at ROOT (its
index at DATABASE_URL, the one the test's node uses), starts loading the
prefix made from SEED, prints ``leased`` once the load holds its lease and has delivered layer 0,
waits for a line on stdin, then takes every layer, compares it with the stored KV, and prints
one JSON line: whether every layer was exact, its security events, and the tenants whose clear
data keys it still caches. Closing the cache then ends the lease.

``python -m tests.fleet_node serve ROOT DATABASE_URL``: a node that takes commands, one JSON
object a line on stdin, and answers each with one JSON line (see :func:`serve`), so a test can
drive two or three such nodes against one index and one extent directory.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tenantkv

from .helpers import MLA_SMALL, layers_equal, random_layers, random_tokens


def main(root: str, database_url: str, seed: int, num_tokens: int) -> None:
    tokens = random_tokens(num_tokens, seed=seed)
    expected = random_layers(MLA_SMALL, num_tokens, seed=seed)
    with tenantkv.open(Path(root), durable=False, database_url=database_url) as kv:
        ns = kv.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        with ns.load(tokens) as stream:
            first = stream.wait_for_layer(0)
            cached_before = sorted(t.hex() for t in kv.context.keys.cached_tenants())
            print("leased", flush=True)
            sys.stdin.readline()
            exact = [layers_equal(first, expected[0])]
            exact += [
                layers_equal(stream.wait_for_layer(i), expected[i])
                for i in range(1, MLA_SMALL.num_layers)
            ]
        # The other node retired keys meanwhile: the key epoch makes this node drop its cached
        # clear keys within a few seconds.
        deadline = time.monotonic() + 10
        while kv.context.keys.cached_tenants() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = {
            "exact": exact,
            "security_events": kv.security_events(),
            "keys_cached_before": cached_before,
            "keys_cached_after": sorted(t.hex() for t in kv.context.keys.cached_tenants()),
        }
        print(json.dumps(report), flush=True)


def _command(
    kv: tenantkv.TenantKV, namespaces: dict[str, tenantkv.Namespace], request: dict[str, Any]
) -> dict[str, Any]:
    """Run one command; a typed error comes back as its class name, never as a crash. The
    namespace is opened once and kept, as an inference server keeps it between requests."""
    if "at" in request:  # a wall-clock start time, so that several nodes act at once
        time.sleep(max(0.0, request["at"] - time.time()))
    op = request["op"]
    if op == "events":
        return {"security_events": kv.security_events(), "health": kv.health_counters()}
    num_tokens = request.get("tokens", 128)
    try:
        if "acme" not in namespaces:
            namespaces["acme"] = kv.namespace("acme", model="fleet-model", layout=MLA_SMALL)
        ns = namespaces["acme"]
        if op == "store":
            stored = [
                ns.store(
                    random_tokens(num_tokens, seed=seed),
                    random_layers(MLA_SMALL, num_tokens, seed=seed),
                )
                for seed in request["seeds"]
            ]
            return {"stored": stored}
        tokens = random_tokens(num_tokens, seed=request["seed"])
        if op == "lookup":
            return {"hit": ns.lookup(tokens)}
        if op == "load":
            expected = random_layers(MLA_SMALL, num_tokens, seed=request["seed"])
            with ns.load(tokens) as stream:
                exact = [
                    layers_equal(stream.wait_for_layer(i), want) for i, want in enumerate(expected)
                ]
            return {"exact": exact}
    except tenantkv.TenantKVError as err:
        return {"error": type(err).__name__}
    raise ValueError(f"unknown command {op!r}")


def serve(root: str, database_url: str) -> None:
    """Answer commands until stdin closes: ``{"op": "store", "seeds": [...]}`` stores the prefix
    of each seed (``"stored"``: tokens newly stored, each); ``lookup`` and ``load`` take one
    ``seed`` (``"hit"``: the cached length; ``"exact"``: whether each layer matched the stored
    KV, or ``"error"``: the typed error's class); ``events`` reports the node's security events
    and health counters. Every command may carry ``tokens`` (default 128) and ``at`` (a wall
    clock time to start at). Prints ``ready`` once the cache is open."""
    with tenantkv.open(Path(root), durable=False, database_url=database_url) as kv:
        print("ready", flush=True)
        namespaces: dict[str, tenantkv.Namespace] = {}
        for line in sys.stdin:
            print(json.dumps(_command(kv, namespaces, json.loads(line))), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
