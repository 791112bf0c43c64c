#!/usr/bin/env bash
# Create (or reuse) the virtual environments, each with kvactors installed (editable). No C++
# compiler is needed.
#   bash scripts/setup.sh            .venv: torch 2.13.0 (CPU build from local disk), runtime +
#                                    CLI (kvactors demo/doctor/bench)
#   bash scripts/setup.sh --test     all of the test job's venvs (the two parts below, in turn):
#     --test main                    .venv: plus test tools and lmcache 0.5.6
#     --test others                  .venv-lmcache057: torch 2.13.0, test tools, lmcache 0.5.7rc2
#                                    (the adapter tests against the second LMCache version);
#                                    .venv-torch24 / .venv-torch25: torch 2.4.1 / 2.5.1 (PyPI's
#                                    builds, about 5 GB each with their CUDA libraries), test
#                                    tools, bench and metrics extras, no lmcache (the matrix);
#                                    .venv-vllm (scripts/setup-engine.sh, where it exists)
#   bash scripts/setup.sh --matrix   prints the matrix ("SUFFIX TORCH_VERSION" per line)
# scripts/test.sh runs "main" first and "others" in the background while the lint and the
# first suite run; "others" builds the matrix venvs and the LMCache 0.5.7rc2 + vLLM venvs at
# the same time. Each step is idempotent: a second run reuses what is there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_BOOT="${PYTHON_BOOT:-python3}"
# The torch version matrix: venv suffix and torch version. The oldest one is the floor
# pyproject.toml declares and kvactors.doctor.TORCH_TESTED names (tests/test_torch_range.py
# checks they agree).
TORCH_MATRIX=("torch24 2.4.1" "torch25 2.5.1")

make_venv() {  # make_venv DIR EXTRAS [TORCH_VERSION]
    local dir="$1" extras="$2" torch_version="${3:-2.13.0}"
    if [ ! -x "$dir/bin/python" ]; then
        "$PY_BOOT" -m venv "$dir"
    fi
    "$dir/bin/python" -m pip install -q --upgrade pip
    # Pin torch first: any unpinned resolution would download another multi-GB build.
    "$dir/bin/python" -m pip install -q "torch==$torch_version"
    "$dir/bin/python" -m pip install -q -c <(echo "torch==$torch_version") -e ".[$extras]"
}

install_lmcache() {  # install_lmcache PYTHON VERSION
    PYTHON="$1" LMCACHE_VERSION="$2" bash scripts/install-lmcache.sh >/dev/null
}

timed() {  # timed LABEL COMMAND...: runs it, then prints how long it took
    local start=$SECONDS
    "${@:2}"
    echo "setup: $1 in $((SECONDS - start)) s"
}

setup_main() {
    timed ".venv (torch 2.13.0)" make_venv .venv test,bench,metrics
    timed ".venv: lmcache 0.5.6" install_lmcache .venv/bin/python 0.5.6
}

setup_lmcache057_and_engine() {
    timed ".venv-lmcache057 (torch 2.13.0)" make_venv .venv-lmcache057 test
    timed ".venv-lmcache057: lmcache 0.5.7rc2" install_lmcache .venv-lmcache057/bin/python 0.5.7rc2
    if [ -f scripts/setup-engine.sh ]; then
        timed ".venv-vllm (scripts/setup-engine.sh)" bash scripts/setup-engine.sh
    fi
}

setup_matrix() {
    local entry suffix version
    for entry in "${TORCH_MATRIX[@]}"; do
        read -r suffix version <<<"$entry"
        timed ".venv-$suffix (torch $version)" make_venv ".venv-$suffix" test,bench,metrics "$version"
    done
}

setup_others() {  # two chains at once: both are mostly downloads and unpacking
    # Each chain runs as a background job, so `set -e` stops it at its first failure (in an
    # `||` list it would not); the exit statuses come back through wait.
    local matrix_pid engine_pid rc=0
    setup_matrix &
    matrix_pid=$!
    setup_lmcache057_and_engine &
    engine_pid=$!
    wait "$matrix_pid" || rc=$?
    wait "$engine_pid" || rc=$?
    return "$rc"
}

case "${1:-} ${2:-}" in
    "--test main") setup_main ;;
    "--test others") setup_others ;;
    "--test ") setup_main; setup_others ;;
    "--matrix ") printf '%s\n' "${TORCH_MATRIX[@]}" ;;  # for scripts/test.sh
    " ") make_venv .venv bench ;;
    *) echo "usage: bash scripts/setup.sh [--test [main|others]]" >&2; exit 2 ;;
esac
