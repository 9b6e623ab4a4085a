#!/usr/bin/env bash
# The engine tests (tests_engines/: vLLM's real Scheduler and LLM on CPU, SGLang's HiCache
# classes, a vllm serve behind the gateway) in .venv-engines, which scripts/setup_engines.sh
# builds. About 6 minutes on 2 cores (2026-12-07: 6:05, the quickstart test 2 min of it).
# The main suite (scripts/test.sh) does not collect them: vLLM is ~3.5 GB with a torch build of
# its own. pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-engines/bin/python ]; then
    echo "no .venv-engines: run scripts/setup_engines.sh first" >&2
    exit 1
fi
.venv-engines/bin/python -m pytest -p no:cacheprovider tests_engines "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
# The one main-suite test that needs vLLM (it skips in the main venv), in a run of its own: the
# two suites' conftests both define --index.
if [ "$#" -eq 0 ]; then
    .venv-engines/bin/python -m pytest -p no:cacheprovider -q \
        tests/test_config_file.py::test_connector_reads_the_file
    connector=$?
    [ "$status" -ne 0 ] || status=$connector
fi
exit "$status"
