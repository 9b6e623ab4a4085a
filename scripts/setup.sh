#!/usr/bin/env bash
# Create .venv and install tenantkv with its dev tools. Idempotent; safe to run again.
# torch is installed first and pinned to 2.13.0: that CPU build is what this machine kind carries,
# and an unpinned torch would make pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev,server,gateway,hf,postgres,metrics,redis]"
.venv/bin/python -c "import tenantkv, torch; print('tenantkv', tenantkv.__version__, 'torch', torch.__version__)"
