#!/usr/bin/env bash
# Lint, type-check, run the test suite, the GPU check's CPU-only part (scripts/gpu_check.sh),
# check the package (scripts/check_package.sh), then run
# the engine tests (vLLM and SGLang in .venv-engines, built here by scripts/setup_engines.sh if
# missing; about 2 min the first time, then seconds), then the peer benchmark's smoke run
# (bench/peers/.venv, built by bench/peers/setup.sh if missing; about 1-2 min the first time,
# then ~20 s). Expects scripts/setup.sh to have run.
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
set -e
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy resolves packages from the file system and cannot follow setuptools' package-dir mapping,
# so it checks an assembled copy laid out as installed (tenantkv/{crypto,storage,audit}).
rm -rf build/typecheck && mkdir -p build/typecheck
cp -r tenantkv build/typecheck/ && cp -r crypto storage audit build/typecheck/tenantkv/
(cd build/typecheck && ../../.venv/bin/mypy --config-file ../../pyproject.toml -p tenantkv)
# The import contracts (pyproject's [tool.importlinter]): layers pointing down, no cycles.
(cd build/typecheck && PYTHONPATH=. ../../.venv/bin/lint-imports --no-cache ../../pyproject.toml)
# pytest-xdist: one worker process per CPU this process may use (cgroup quota and affinity,
# tenantkv.host_cpus), at most 4: each worker opens PostgreSQL pools of its own, and more workers
# than CPUs pushes index calls past their 2 s bounds (seen with 4 workers on 2 CPUs). 18.7 ->
# 10.5 min on 2 CPUs. A later `-n 0` among the arguments runs the tests in this one process.
workers=$(.venv/bin/python -c "from tenantkv.host_cpus import usable_cpu_count as n; print(min(4, n()))")
set +e
.venv/bin/python -m pytest -n "$workers" "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
# The GPU check (scripts/gpu_check.sh): without CUDA its CPU-only part (~30 s), so it never rots;
# TENANTKV_SKIP_GPU_CHECK=1 skips it.
if [ "${TENANTKV_SKIP_GPU_CHECK:-0}" = 1 ]; then
    echo "scripts/gpu_check.sh SKIPPED (TENANTKV_SKIP_GPU_CHECK=1)" >&2
elif ! bash scripts/gpu_check.sh; then
    [ "$status" -ne 0 ] || status=1
fi
# Packaging as a user meets it: the wheel in fresh venvs, bare and with each extra alone (about
# 2.5 min; TENANTKV_SKIP_PACKAGE_CHECK=1 skips it, e.g. while iterating on a few tests).
if [ "${TENANTKV_SKIP_PACKAGE_CHECK:-0}" = 1 ]; then
    echo "scripts/check_package.sh SKIPPED (TENANTKV_SKIP_PACKAGE_CHECK=1)" >&2
elif ! bash scripts/check_package.sh; then
    [ "$status" -ne 0 ] || status=1
fi
# The engine tests (tests_engines/, about 6 min) run in a venv of their own: vLLM is ~3.5 GB with
# a torch build of its own. TENANTKV_SKIP_ENGINES=1 skips them, like the package check.
if [ "${TENANTKV_SKIP_ENGINES:-0}" = 1 ]; then
    echo "scripts/test_engines.sh SKIPPED (TENANTKV_SKIP_ENGINES=1)" >&2
elif ! { bash scripts/setup_engines.sh && bash scripts/test_engines.sh; }; then
    [ "$status" -ne 0 ] || status=1
fi
# The peer benchmark (bench/peers/: LMCache, safetensors, torch.save beside tenantkv) in its own
# venv, so that its scripts never rot: bench/peers/test_smoke.sh builds bench/peers/.venv when it
# is missing or stale and runs peers.py --smoke. TENANTKV_SKIP_PEERS=1 skips it.
if [ "${TENANTKV_SKIP_PEERS:-0}" = 1 ]; then
    echo "bench/peers/test_smoke.sh SKIPPED (TENANTKV_SKIP_PEERS=1)" >&2
elif ! bash bench/peers/test_smoke.sh; then
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
