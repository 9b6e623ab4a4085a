"""How ``rows.json`` and ``root/`` were made, kept for the record (not run by the tests).

A cache written by the milestone-1 code (commit 2e18036), whose index the migration tests rebuild
on either backend (tests/milestone1_schema.py) and upgrade. Run once, with that code first on the
path (its package-dir mapping laid out by symlinks)::

    git archive 2e18036 | tar -x -C /tmp/m1
    for p in crypto storage audit; do ln -s ../$p /tmp/m1/tenantkv/$p; done
    PYTHONPATH=/tmp/m1 .venv/bin/python tests/data/milestone1/generate_milestone1.py /tmp/m1out

then copy ``rows.json``, ``root/master.key`` and ``root/blocks`` here. The prefix (tokens and
layers) is the one ``tests/test_migrations.py`` recomputes to check the load byte for byte.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import create_engine, inspect, text

import tenantkv
from tenantkv import KVLayout
from tenantkv.server.auth import create_token

LAYERS, TOKENS = 2, 128
LAYOUT = KVLayout.mla(LAYERS, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)


def layer(index: int) -> torch.Tensor:
    values = torch.arange(TOKENS * 576, dtype=torch.float32).reshape(TOKENS, 576)
    return (values % 251 - 125 + index).to(torch.bfloat16)


def main(out: Path) -> None:
    root = out / "root"
    shutil.rmtree(out, ignore_errors=True)
    root.mkdir(parents=True)
    now = [1_780_000_000.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    tokens = list(range(1000, 1000 + TOKENS))
    layers = [layer(i) for i in range(LAYERS)]
    with tenantkv.open(root, clock=clock) as kv:
        kv.create_tenant("acme")
        kv.create_tenant("globex")
        namespace = kv.namespace("acme", model="tiny-m1", layout=LAYOUT)
        assert namespace.store(tokens, layers) == TOKENS
        assert namespace.lookup(tokens) == TOKENS
        with namespace.load(tokens) as stream:
            for index, got in stream:
                assert torch.equal(got, layers[index])
        operator = create_token(kv, "operator")
        admin = create_token(kv, "tenant-admin", "acme")
    engine = create_engine(f"sqlite:///{root / 'index.db'}")
    tables: dict[str, list[dict[str, Any]]] = {}
    with engine.connect() as connection:
        for table in sorted(inspect(connection).get_table_names()):
            names = [c["name"] for c in inspect(connection).get_columns(table)]
            tables[table] = [
                {
                    k: {"hex": v.hex()} if isinstance(v, bytes) else v
                    for k, v in zip(names, row, strict=True)
                }
                for row in connection.execute(text(f'SELECT * FROM "{table}"'))
            ]
    engine.dispose()
    tokens_made = {"operator": operator, "acme_admin": admin}
    dump = {"tables": tables, "tokens": tokens_made}
    (out / "rows.json").write_text(json.dumps(dump, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
