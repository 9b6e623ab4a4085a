#!/usr/bin/env bash
# The GPU check (issue 35): on a host with an NVIDIA GPU, the CUDA tests (pytest -m cuda: the
# tests skipped without CUDA), then a 128K-token DeepSeek-V3 latent restore (8.6 GiB) to the GPU
# layer by layer, timed (first layer, whole restore) against a plain host-to-device copy of the
# same bytes from pinned memory (bench/gpu_restore.py); one short run, under 5 minutes.
#
# Without CUDA it runs the CPU-only parts -- the same restore script end to end at a small size
# on the CPU -- and says that it skipped the GPU. scripts/test.sh runs it that way (under ~30 s)
# so that it never rots.
#
#   bash scripts/gpu_check.sh                 # whatever the host has
#   PYTHON=/path/to/python bash scripts/gpu_check.sh   # a Python with tenantkv and CUDA torch
#   TENANTKV_GPU_CHECK_INDEX=postgresql ...   # the index backends of the CUDA tests (sqlite)
#   TENANTKV_GPU_CHECK_TOKENS=65536 ...       # a shorter prefix on a small GPU (131072)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
status=0
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "== GPU: $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    echo "== CUDA tests (pytest -m cuda)"
    # -rs lists skips: on a GPU host a skipped CUDA test is a finding, not a pass
    if ! timeout 150 "$PY" -m pytest tests/ -m cuda -q -rs -p no:cacheprovider \
        --index="${TENANTKV_GPU_CHECK_INDEX:-sqlite}"; then
        status=1
    fi
    echo "== 128K-token DeepSeek-V3 latent restore to the GPU vs a pinned host-to-device copy"
    if ! timeout 240 "$PY" bench/gpu_restore.py --device cuda \
        --tokens "${TENANTKV_GPU_CHECK_TOKENS:-131072}" --reps 3; then
        status=1
    fi
else
    echo "== GPU: SKIPPED (no CUDA device): the CUDA tests did not run; the restore runs its"
    echo "   CPU-only path (same script, small size). Run this on a CUDA host for GPU figures."
    if ! timeout 120 "$PY" bench/gpu_restore.py --device cpu --cpu-tokens 512 --reps 2; then
        status=1
    fi
fi
exit "$status"
