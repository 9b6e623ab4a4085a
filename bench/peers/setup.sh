#!/usr/bin/env bash
# Build bench/peers/.venv: the peer benchmark's own venv (LMCache, safetensors, matplotlib beside
# tenantkv), kept out of the project's venv and dependencies. Idempotent; safe to run again.
# Measured: 60 s for a fresh venv on the 2-core dev VM with pip's cache warm (a cold cache also
# downloads the wheels; the venv is 1.7 GB installed, 0.75 GB of it torch's CPU build).
#
# Order matters:
#   1. torch==2.13.0 first: the CPU build on this machine; a looser spec fetches GBs of CUDA;
#   2. the peers' pinned requirements (requirements.txt);
#   3. tenantkv from this repository, editable, no extras (it must be importable);
#   4. lmcache==0.5.6 with --no-deps (requirements-lmcache.txt): its declared dependencies pull
#      CUDA builds; LocalDiskBackend on the CPU needs only what requirements.txt lists.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON=${PYTHON:-python3}
V="$HERE/.venv"
if [ ! -x "$V/bin/python" ]; then
    "$PYTHON" -m venv "$V"
fi
"$V/bin/python" -m pip install --quiet --upgrade pip
"$V/bin/python" -m pip install --quiet "torch==2.13.0"
"$V/bin/python" -m pip install --quiet -r "$HERE/requirements.txt"
"$V/bin/python" -m pip install --quiet -e "$REPO"
"$V/bin/python" -m pip install --quiet --no-deps -r "$HERE/requirements-lmcache.txt"
"$V/bin/python" - <<'PY'
import importlib.metadata as m

import safetensors
import tenantkv
import torch
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: F401

assert torch.__version__.startswith("2.13.0"), torch.__version__
print(
    "peers venv: tenantkv", tenantkv.__version__, "torch", torch.__version__,
    "lmcache", m.version("lmcache"), "safetensors", safetensors.__version__,
)
PY
# What scripts/test.sh compares to decide whether the venv is current.
cat "$HERE/setup.sh" "$HERE/requirements.txt" "$HERE/requirements-lmcache.txt" \
    | sha256sum > "$V/.peers-setup.sha256"
