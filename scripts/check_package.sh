#!/usr/bin/env bash
# Packaging as a user meets it: build the wheel, install it into fresh venvs beside torch==2.13.0,
# and use it. Exits non-zero on the first failure; prints what it checked.
#
#   base      the wheel with no extras: `pip check`, the README's "Use" example end to end
#             (scripts/readme_use_example.py: store, lookup, load, bytes compared), every module
#             that needs no extra imports (an undeclared dependency fails here), `tenantkv init`
#   server    the wheel with [server] alone: imports, create_app on an opened cache, GET /healthz
#             through the ASGI interface, uvicorn importable (what `tenantkv serve` runs)
#   hf        the wheel with [hf] alone: imports (tenantkv.integrations.transformers), and the
#             README's main job, `tenantkv demo --fast`
#   postgres  the wheel with [postgres] alone: psycopg imports, and the Use example runs on
#             PostgreSQL ($TENANTKV_PKGCHECK_POSTGRES, default postgresql://postgres@127.0.0.1:5432/test)
#             in a fresh schema that is dropped afterwards. If the server is not reachable that
#             part is reported as skipped (set TENANTKV_PKGCHECK_REQUIRE_POSTGRES=1 to fail instead)
#   metrics   the wheel with [metrics] alone: a lookup moves tenantkv_miss_tokens_total in the
#             cache's own registry (in the bare install metrics are no-ops: metrics_registry None)
#   redis     the wheel with [redis] alone: redis-py imports, and open_block_store("redis://...")
#             builds a RedisBlockStore (no server needed: connections are made on first use)
#
# How the venvs are made, and why this is still a fresh install: `pip install torch==2.13.0` takes
# about a minute here (unpacking ~900 MB), so doing it once per venv would make this check take
# five. Instead torch is installed once, by pip, into a torch-only template venv
# (build/pkgcheck/torch-template, kept between runs and rebuilt when the torch pin or the Python
# changes; delete build/pkgcheck to rebuild it by hand). Each check then creates a new venv
# (`python -m venv --without-pip`) and hard-links the template's site-packages into it (a copy
# where hard links are not possible) - under a second. Every check venv therefore starts with
# exactly what `pip install torch==2.13.0` leaves in a fresh venv (pip, setuptools, torch and
# its requirements; not torch's console scripts, which nothing here uses) and nothing else; the
# wheel and each extra's requirements are then resolved and installed by pip as a user's would
# be. pip replaces files rather than writing into them, so the template is never modified.
# The wheel is built with `pip wheel --no-deps` from a copy of the files git tracks or would
# track (not from the work tree, whose build/ could leak stale modules into the wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
WORK="$REPO/build/pkgcheck"
PG_CONNINFO=${TENANTKV_PKGCHECK_POSTGRES:-postgresql://postgres@127.0.0.1:5432/test}
EXTRAS="server hf postgres metrics redis gateway"
# top-level modules each extra brings: when checking one install, the other extras' are allowed
# to be missing (and only those)
declare -A EXTRA_MODULES=(
    [server]="fastapi starlette pydantic pydantic_settings uvicorn"
    [hf]="transformers"
    [postgres]="psycopg"
    [metrics]="prometheus_client"
    [redis]="redis hiredis"
    [gateway]="fastapi starlette uvicorn httpx xxhash"
)
# The extras `vllm` and `sglang` are not installed here: vLLM is ~3.5 GB with a torch build of its
# own (it would replace the pinned torch), and SGLang's full dependency set pulls CUDA kernels.
# scripts/setup_engines.sh installs both into .venv-engines, where scripts/test_engines.sh imports
# and runs tenantkv.integrations.vllm and .sglang. Likewise LiteLLM (requirements/litellm.txt),
# which pins FastAPI and pydantic of its own: scripts/setup_litellm.sh installs it into
# .venv-litellm, where the LiteLLM hook's test imports tenantkv.integrations.litellm. Here their
# modules may only fail to import for want of these packages.
UNCHECKED_EXTRA_MODULES="vllm sglang litellm"
started=$SECONDS
checked=()

step() { printf '\n== [%3d s] %s\n' "$((SECONDS - started))" "$*"; }
fail() {
    echo "check_package: FAILED: $*" >&2
    exit 1
}
# run a command quietly, its output in a log that is shown when it fails
logged() {
    local log=$1
    shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        fail "$* (log: $log)"
    fi
}
# run a check from a scratch directory, so that the source tree is not on sys.path
in_scratch() { (cd "$SCRATCH" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$@"); }

mkdir -p "$WORK"
rm -rf "$WORK/scratch" "$WORK/logs"
mkdir -p "$WORK/scratch" "$WORK/logs"
SCRATCH="$WORK/scratch"
LOGS="$WORK/logs"
printf '%s\n' "$TORCH_PIN" >"$WORK/torch-constraint.txt"

# --- the torch-only template ---------------------------------------------------------------
template="$WORK/torch-template"
stamp="$TORCH_PIN $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if [ "$(cat "$template/.pkgcheck-stamp" 2>/dev/null || true)" != "$stamp" ]; then
    step "template venv: $TORCH_PIN alone (once; kept in $template)"
    rm -rf "$template"
    logged "$LOGS/template.log" "$PYTHON" -m venv "$template"
    logged "$LOGS/template.log" "$template/bin/python" -m pip install --quiet "$TORCH_PIN"
    printf '%s\n' "$stamp" >"$template/.pkgcheck-stamp"
fi
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
# the torch version in venv $1, from its metadata (importing torch costs seconds)
torch_version() {
    in_scratch "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'
}
template_site=$(purelib "$template")
template_torch=$(torch_version "$template")
[ "${template_torch%%+*}" = "${TORCH_PIN#torch==}" ] || fail "template holds torch $template_torch"
# whether venv $1 still holds the template's torch (the same build: pip did not replace it)
torch_is_pinned() { [ "$(torch_version "$1")" = "$template_torch" ]; }

# a new venv named $1 holding what `pip install torch==2.13.0` installs into a fresh venv
fresh_venv() {
    local venv="$WORK/venv-$1" site
    rm -rf "$venv"
    "$PYTHON" -m venv --without-pip "$venv"
    site=$(purelib "$venv")
    if ! cp -al "$template_site/." "$site/" 2>/dev/null; then
        rm -rf "$site" && mkdir -p "$site" && cp -a "$template_site/." "$site/"
    fi
    torch_is_pinned "$venv" || fail "venv $venv: no $TORCH_PIN from the template"
}
install() {
    local venv=$1 name=$2
    shift 2
    logged "$LOGS/install-$name.log" "$venv/bin/python" -m pip install --no-compile --constraint \
        "$WORK/torch-constraint.txt" "$@"
    torch_is_pinned "$venv" || fail "installing $* replaced $TORCH_PIN"
    logged "$LOGS/pip-check-$name.log" in_scratch "$venv/bin/python" -m pip check
}

# --- the wheel -----------------------------------------------------------------------------
step "wheel: pip wheel --no-deps from a clean copy of the tree"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || fail "not a git checkout"
rm -rf "$WORK/src" "$WORK/dist"
mkdir -p "$WORK/src"
# tracked and untracked-but-not-ignored files that exist (a deleted tracked file is skipped)
git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$WORK/src"
logged "$LOGS/wheel.log" "$template/bin/python" -m pip wheel --no-deps -w "$WORK/dist" "$WORK/src"
wheels=("$WORK"/dist/tenantkv-*.whl)
[ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel in $WORK/dist"
WHEEL=${wheels[0]}
echo "built $(basename "$WHEEL")"
checked+=("wheel builds")

# --- base: no extras -----------------------------------------------------------------------
step "base: $(basename "$WHEEL") with no extras, beside $TORCH_PIN"
fresh_venv base
venv="$WORK/venv-base"
install "$venv" base "$WHEEL"
# every extra's modules must be absent, or this would not be the bare install
# shellcheck disable=SC2086  # word splitting of the module lists is intended
in_scratch "$venv/bin/python" -c '
import importlib.util, sys
present = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]
assert not present, f"the bare install has extras modules: {present}"
' ${EXTRA_MODULES[server]} ${EXTRA_MODULES[hf]} ${EXTRA_MODULES[postgres]} \
    ${EXTRA_MODULES[metrics]} ${EXTRA_MODULES[redis]} ${EXTRA_MODULES[gateway]} || fail "base venv is not bare"
in_scratch "$venv/bin/python" "$REPO/scripts/readme_use_example.py" "$SCRATCH/base-cache" ||
    fail "base: the README's Use example"
# shellcheck disable=SC2086
in_scratch "$venv/bin/python" "$REPO/scripts/pkgcheck_imports.py" \
    ${EXTRA_MODULES[server]} ${EXTRA_MODULES[hf]} ${EXTRA_MODULES[postgres]} \
    ${EXTRA_MODULES[metrics]} ${EXTRA_MODULES[redis]} ${EXTRA_MODULES[gateway]} $UNCHECKED_EXTRA_MODULES ||
    fail "base: a module does not import"
in_scratch "$venv/bin/python" "$REPO/scripts/pkgcheck_metrics.py" "$SCRATCH/base-metrics" absent ||
    fail "base: a cache without prometheus_client"
logged "$LOGS/cli-init.log" in_scratch "$venv/bin/tenantkv" init "$SCRATCH/cli-root"
echo "tenantkv init (console script): ok"
# setup.py's optional C accelerators (prefix key chain, token-id packing, codec decoders): built
# here (this machine has a C compiler), so a wheel without them is a build that silently fell
# back to the slower Python and torch paths
in_scratch "$venv/bin/python" -c 'from tenantkv import codecs, prefix, tokens; assert prefix.c_chain and tokens._pack and codecs.kernels' ||
    fail "base: the wheel lacks the C accelerators (tenantkv._prefix_chain, tenantkv._token_ids, tenantkv._codec_kernels)"
checked+=("base: pip check, README Use example, imports, tenantkv init, no-op metrics, C accelerators")

# --- each extra alone ----------------------------------------------------------------------
others_of() {
    local extra=$1 e
    for e in $EXTRAS; do
        [ "$e" = "$extra" ] || printf '%s ' ${EXTRA_MODULES[$e]}
    done
    printf '%s ' $UNCHECKED_EXTRA_MODULES
}

for extra in $EXTRAS; do
    step "$extra: $(basename "$WHEEL")[$extra] alone, beside $TORCH_PIN"
    fresh_venv "$extra"
    venv="$WORK/venv-$extra"
    install "$venv" "$extra" "$WHEEL[$extra]"
    # shellcheck disable=SC2046
    in_scratch "$venv/bin/python" "$REPO/scripts/pkgcheck_imports.py" $(others_of "$extra") ||
        fail "$extra: a module does not import"
    case $extra in
    server)
        in_scratch "$venv/bin/python" - "$SCRATCH/server-cache" <<'EOF' || fail "server: create_app"
import asyncio
import json
import sys

import uvicorn  # noqa: F401  (what `tenantkv serve` runs the app with)

import tenantkv
from tenantkv.server.app import create_app


async def get(app, path):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"localhost")],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


with tenantkv.open(sys.argv[1]) as kv:
    app = create_app(kv)
    status, body = asyncio.run(get(app, "/healthz"))
    assert status == 200, (status, body)
    print(f"create_app on an opened cache: GET /healthz -> {status} {json.loads(body)}")
EOF
        checked+=("server alone: imports, create_app, GET /healthz, uvicorn")
        ;;
    gateway)
        in_scratch "$venv/bin/python" - <<'EOF' || fail "gateway: create_gateway_app"
import asyncio

import uvicorn  # noqa: F401  (what `tenantkv gateway` runs the app with)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tenantkv.gateway import GatewaySettings, create_gateway_app
from tenantkv.tenant_assertion import AssertionSigner


class NoKeys:
    def authenticate(self, secret):
        return None


async def get(app, path):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"localhost")],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    return sent[0]["status"]


app = create_gateway_app(
    NoKeys(),
    AssertionSigner(Ed25519PrivateKey.generate()),
    secret=b"s" * 32,
    backends=["http://127.0.0.1:9"],
    settings=GatewaySettings(audience="pkgcheck"),
)
status = asyncio.run(get(app, "/healthz"))
assert status == 200, status
print("create_gateway_app: GET /healthz ->", status)
EOF
        checked+=("gateway: imports, create_gateway_app answers /healthz")
        ;;
    hf)
        logged "$LOGS/demo.log" in_scratch "$venv/bin/tenantkv" demo --fast
        echo "tenantkv demo --fast: $(grep -E '^demo ' "$LOGS/demo.log" | tail -n 1)"
        checked+=("hf alone: imports, tenantkv demo --fast")
        ;;
    postgres)
        set +e
        in_scratch "$venv/bin/python" - "$PG_CONNINFO" "$REPO/scripts/readme_use_example.py" \
            "$SCRATCH/postgres-cache" <<'EOF'
import secrets
import subprocess
import sys
from urllib.parse import quote

import psycopg

conninfo, example, root = sys.argv[1:4]
try:
    admin = psycopg.connect(conninfo, connect_timeout=5, autocommit=True)
except psycopg.OperationalError as err:
    print(f"PostgreSQL at {conninfo} is not reachable: {err}".strip())
    sys.exit(3)
schema = f"tkv_pkgcheck_{secrets.token_hex(6)}"
with admin:
    admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        separator = "&" if "?" in conninfo else "?"
        url = (
            conninfo.replace("postgresql://", "postgresql+psycopg://", 1)
            + separator
            + "options="
            + quote(f"-csearch_path={schema}")
        )
        print(f"psycopg {psycopg.__version__}; schema {schema}")
        code = subprocess.run([sys.executable, example, root, url]).returncode
        tables = admin.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchone()[0]
        if code == 0 and tables == 0:
            print(f"the example created no tables in {schema}: search_path was not used")
            code = 1
    finally:
        admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
sys.exit(code)
EOF
        status=$?
        set -e
        if [ "$status" -eq 3 ] && [ "${TENANTKV_PKGCHECK_REQUIRE_POSTGRES:-0}" != 1 ]; then
            echo "SKIPPED the PostgreSQL part (set TENANTKV_PKGCHECK_REQUIRE_POSTGRES=1 to fail)"
            checked+=("postgres alone: imports (PostgreSQL not reachable: Use example SKIPPED)")
        elif [ "$status" -ne 0 ]; then
            fail "postgres: the README's Use example on PostgreSQL"
        else
            checked+=("postgres alone: imports, README Use example on PostgreSQL")
        fi
        ;;
    metrics)
        in_scratch "$venv/bin/python" "$REPO/scripts/pkgcheck_metrics.py" "$SCRATCH/metrics" present ||
            fail "metrics: the cache's registry"
        checked+=("metrics alone: a lookup moves tenantkv_miss_tokens_total")
        ;;
    redis)
        in_scratch "$venv/bin/python" -c '
from tenantkv.storage.urls import open_block_store
from tenantkv.storage.redis_store import RedisBlockStore
store = open_block_store("redis://127.0.0.1:6379/0?prefix=pkgcheck:", durable=False)
assert isinstance(store, RedisBlockStore)
store.close()
print("redis alone: open_block_store(redis://...) builds a RedisBlockStore")
' || fail "redis: open_block_store"
        checked+=("redis alone: imports, open_block_store builds a RedisBlockStore")
        ;;
    esac
done

step "check_package: passed in $((SECONDS - started)) s"
printf '  %s\n' "${checked[@]}"
