#!/usr/bin/env bash
# The peer benchmark's smoke run, as scripts/test.sh runs it: (re)build bench/peers/.venv when
# it is missing or its setup inputs changed, then `peers.py --smoke` (tiny sizes, one round, every
# system including LMCache, 16 tenants; every loaded byte still checked; ~20 s). Its outputs go
# to a temporary directory, never over BENCHMARKS.md or bench/peers/results.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
V="$HERE/.venv"
want=$(cat "$HERE/setup.sh" "$HERE/requirements.txt" "$HERE/requirements-lmcache.txt" | sha256sum)
if [ ! -x "$V/bin/python" ] || [ "$(cat "$V/.peers-setup.sha256" 2>/dev/null)" != "$want" ]; then
    bash "$HERE/setup.sh"
fi
"$V/bin/python" "$HERE/peers.py" --smoke
