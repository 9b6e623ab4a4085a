#!/usr/bin/env bash
# Create .venv-litellm: LiteLLM's proxy (requirements/litellm.txt) beside tenantkv, for the
# LiteLLM hook's end-to-end test (tests_engines/test_litellm_hook.py), which runs the proxy as a
# child process. Idempotent; safe to run again. Called by scripts/setup_engines.sh.
#
# Why a venv of its own: LiteLLM's proxy pins FastAPI, pydantic, uvicorn and more to versions of
# its own, which need not agree with vLLM's (.venv-engines) or with the main suite's (.venv).
# torch is installed first and pinned (tenantkv depends on it; an unpinned one would fetch a
# multi-GB CUDA build). Then a check that no .pth start-up file came with LiteLLM: that is how
# compromised LiteLLM releases ran code at every interpreter start.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
V=.venv-litellm
if [ ! -x "$V/bin/python" ]; then
    "$PYTHON" -m venv "$V"
fi
"$V/bin/python" -m pip install --quiet --upgrade pip
"$V/bin/python" -m pip install --quiet "torch==2.13.0"
"$V/bin/python" -m pip install --quiet -r requirements/litellm.txt
"$V/bin/python" -m pip install --quiet -e ".[gateway,postgres]"
"$V/bin/python" -m pip check
LITELLM_LOCAL_MODEL_COST_MAP=True "$V/bin/python" - <<'PY'
import importlib.metadata as m
import pathlib
import site

dist = m.distribution("litellm")
startup = [str(f) for f in dist.files or () if str(f).endswith(".pth")]
assert not startup, f"litellm installs start-up files: {startup}"
for directory in site.getsitepackages():
    for pth in pathlib.Path(directory).glob("*.pth"):
        text = pth.read_text(errors="replace")
        assert "litellm" not in text.lower(), f"{pth} mentions litellm: {text[:200]!r}"

import tenantkv.integrations.litellm  # noqa: F401  (the hook imports beside this LiteLLM)

print("litellm", dist.version)
PY
