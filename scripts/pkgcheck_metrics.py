"""Data-plane metrics as an installed wheel meets them; used by scripts/check_package.sh.

    python scripts/pkgcheck_metrics.py ROOT present|absent

``present`` (the ``metrics`` extra): a lookup's missed tokens show in the cache's own registry.
``absent`` (the bare install): metrics are no-ops, ``metrics_registry`` is None, and the cache
still looks up, stores and loads.
"""

from __future__ import annotations

import sys

import torch

import tenantkv


def main(argv: list[str]) -> int:
    root, expected = argv[1], argv[2]
    layout = tenantkv.KVLayout.mla(2, 16, 16, torch.bfloat16)
    tokens = list(range(2 * tenantkv.BLOCK_TOKENS))
    with tenantkv.open(root) as kv:
        kv.create_tenant("t")
        ns = kv.namespace("t", model="m", layout=layout)
        assert ns.lookup(tokens) == 0
        layers = [torch.zeros(len(tokens), 32, dtype=torch.bfloat16) for _ in range(2)]
        assert ns.store(tokens, layers) == len(tokens)
        with ns.load(tokens) as stream:
            assert len(list(stream)) == 2
        if expected == "absent":
            assert kv.metrics_registry is None, "no prometheus_client, yet a registry"
            print("bare install: metrics are no-ops (metrics_registry None); store and load work")
            return 0
        from prometheus_client import generate_latest

        assert kv.metrics_registry is not None, "prometheus_client is installed, no registry"
        text = generate_latest(kv.metrics_registry).decode()
        assert f"tenantkv_miss_tokens_total {float(len(tokens))}" in text, text
        assert "tenantkv_time_to_first_layer_seconds_count 1.0" in text, text
        print("metrics extra: a lookup's missed tokens and a load are in kv.metrics_registry")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
