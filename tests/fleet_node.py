"""A second cache node for the fleet tests, run as its own process on the same root.

``python -m tests.fleet_node ROOT DATABASE_URL SEED NUM_TOKENS``: opens the cache at ROOT (its
index at DATABASE_URL, the one the test's node uses), starts loading the
prefix made from SEED, prints ``leased`` once the load holds its lease and has delivered layer 0,
waits for a line on stdin, then takes every layer, compares it with the stored KV, and prints
one JSON line: whether every layer was exact, its security events, and the tenants whose clear
data keys it still caches. Closing the cache then ends the lease.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
