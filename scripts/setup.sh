#!/usr/bin/env bash
# Create (or reuse) .venv with torch 2.13.0 (CPU build from local disk) and kvactors installed.
#   bash scripts/setup.sh            runtime + CLI (kvactors demo/doctor/bench)
#   bash scripts/setup.sh --test     plus test tools and lmcache 0.5.6 for the adapter tests
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_BOOT="${PYTHON_BOOT:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY_BOOT" -m venv .venv
fi
PY=.venv/bin/python
"$PY" -m pip install -q --upgrade pip
# Pin torch first: any unpinned resolution would download a multi-GB CUDA build.
"$PY" -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
    "$PY" -m pip install -q -c <(echo "torch==2.13.0") -e '.[test,bench,metrics]'
    PYTHON="$PY" bash scripts/install-lmcache.sh >/dev/null
else
    "$PY" -m pip install -q -c <(echo "torch==2.13.0") -e '.[bench]'
fi
