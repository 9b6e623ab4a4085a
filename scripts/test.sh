#!/usr/bin/env bash
# Lint, type-check and run the test suite. Expects scripts/setup.sh to have run.
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
set +e
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
