#!/usr/bin/env bash
# Create (or reuse) the virtual environments, each with torch 2.13.0 (CPU build from local disk)
# and kvactors installed (editable).
#   bash scripts/setup.sh            .venv: runtime + CLI (kvactors demo/doctor/bench)
#   bash scripts/setup.sh --test     .venv: plus test tools and lmcache 0.5.6;
#                                    .venv-lmcache057: the same with lmcache 0.5.7rc2, for the
#                                    adapter tests against the second LMCache version
#                                    (scripts/test.sh runs tests/adapters in both)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_BOOT="${PYTHON_BOOT:-python3}"

make_venv() {  # make_venv DIR EXTRAS
    local dir="$1" extras="$2"
    if [ ! -x "$dir/bin/python" ]; then
        "$PY_BOOT" -m venv "$dir"
    fi
    "$dir/bin/python" -m pip install -q --upgrade pip
    # Pin torch first: any unpinned resolution would download a multi-GB CUDA build.
    "$dir/bin/python" -m pip install -q "torch==2.13.0"
    "$dir/bin/python" -m pip install -q -c <(echo "torch==2.13.0") -e ".[$extras]"
}

if [ "${1:-}" = "--test" ]; then
    make_venv .venv test,bench,metrics
    PYTHON=.venv/bin/python LMCACHE_VERSION=0.5.6 bash scripts/install-lmcache.sh >/dev/null
    make_venv .venv-lmcache057 test
    PYTHON=.venv-lmcache057/bin/python LMCACHE_VERSION=0.5.7rc2 \
        bash scripts/install-lmcache.sh >/dev/null
else
    make_venv .venv bench
fi
