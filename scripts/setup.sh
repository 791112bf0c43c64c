#!/usr/bin/env bash
# Create (or reuse) the virtual environments and install kvactors (editable) from this checkout
# into each. No C++ compiler is needed.
#   bash scripts/setup.sh            .venv: torch 2.13.0 (CPU build from local disk), runtime +
#                                    CLI (kvactors demo/doctor/bench)
#   bash scripts/setup.sh --test     all of the test job's venvs (the two parts below, in turn):
#     --test main                    .venv: plus test tools and lmcache 0.5.6
#     --test others                  .venv-lmcache057: torch 2.13.0, test tools, lmcache 0.5.7rc2
#                                    (the adapter tests against the second LMCache version);
#                                    .venv-torch27: torch 2.7.1 (PyPI's build, about 5 GB with its
#                                    CUDA libraries), test tools, no lmcache (the torch floor);
#                                    .venv-vllm (scripts/setup-engine.sh)
#   bash scripts/setup.sh --matrix   prints the torch lanes besides .venv ("SUFFIX VERSION")
#
# The venvs live in a store outside the checkout (KVACTORS_VENV_STORE, default
# ~/.cache/kvactors/venvs), one directory per environment and key; `.venv*` in the checkout are
# links into it. The key is a hash of everything that builds the environment: its name and
# extras, the torch version, the Python that runs it, the dependencies pyproject.toml declares,
# requirements/, this script, scripts/install-lmcache.sh and scripts/setup-engine.sh. A second
# checkout on the same machine (CI's fresh clone) reuses a finished environment at the same key
# and only installs kvactors from itself (`pip install --no-deps -e .`, seconds). An environment
# is used only once its build finished (a stamp file); an interrupted one is rebuilt. The two
# newest keys of each environment are kept, older ones removed.
# scripts/test.sh runs "main" first and "others" in the background while the lint and the
# first suite run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY_BOOT="${PYTHON_BOOT:-python3}"
STORE="${KVACTORS_VENV_STORE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kvactors/venvs}"
# The torch lanes besides .venv's 2.13.0: venv suffix and torch version. The oldest one is the
# floor pyproject.toml declares and kvactors.cli.torch_range.TORCH_TESTED names
# (tests/cli/test_torch_range.py checks they agree): torch 2.7.1 is what Cambricon's vLLM-MLU
# pins and the oldest torch torch_musa ships for.
TORCH_MATRIX=("torch27 2.7.1")
TORCH_MAIN="2.13.0"

timed() {  # timed LABEL COMMAND...: runs it, then prints how long it took
    local start=$SECONDS
    "${@:2}"
    echo "setup: $1 in $((SECONDS - start)) s"
}

env_key() {  # env_key NAME EXTRAS TORCH: the hash of everything that builds that environment
    {
        echo "$1 [$2] torch==$3"
        "$PY_BOOT" -c 'import sys; print(sys.version)'
        "$PY_BOOT" - <<'PYEOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(project["requires-python"], project["dependencies"], project["optional-dependencies"])
PYEOF
        cat requirements/* scripts/setup.sh scripts/install-lmcache.sh scripts/setup-engine.sh
    } | sha256sum | cut -c1-16
}

link_env() {  # link_env LINK TARGET: the checkout's .venv* name points into the store
    local link="$1" target="$2"
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        echo "setup: $link is a directory of an older layout; replaced by a link into $STORE"
        rm -rf "$link"
    fi
    ln -sfn "$target" "$link"
}

prune() {  # prune DIR: keep the two newest keys of DIR's environment
    local old
    # shellcheck disable=SC2012
    for old in $(ls -1dt "${1%.*}".* 2>/dev/null | grep -v '\.lock$' | tail -n +3); do
        echo "setup: removing an older environment $old"
        rm -rf "$old"
    done
}

in_store() {  # in_store LINK DIR COMMAND...: COMMAND under DIR's lock, then LINK points to DIR
    mkdir -p "$STORE"
    (
        flock 9
        "${@:3}"
        touch "$2"  # the newest used: the last a prune removes
    ) 9>"$2.lock"
    link_env "$1" "$2"
}

build_env() {  # build_env DIR EXTRAS TORCH [LMCACHE]: reuse DIR once built, else build it anew
    local dir="$1" extras="$2" torch_version="$3" lmcache="${4:-}"
    if [ -f "$dir/.kvactors-built" ] && "$dir/bin/python" -c 'import torch' 2>/dev/null; then
        echo "setup: reusing $dir"
        return
    fi
    echo "setup: building $dir"
    rm -rf "$dir"
    "$PY_BOOT" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    # Pin torch first: any unpinned resolution would download another multi-GB build.
    "$dir/bin/python" -m pip install -q "torch==$torch_version"
    "$dir/bin/python" -m pip install -q -c <(echo "torch==$torch_version") -e ".[$extras]" \
        hatchling editables
    if [ -n "$lmcache" ]; then
        PYTHON="$dir/bin/python" LMCACHE_VERSION="$lmcache" bash scripts/install-lmcache.sh \
            >/dev/null
    fi
    touch "$dir/.kvactors-built"
    prune "$dir"
}

build_engine() {  # build_engine DIR: scripts/setup-engine.sh keeps its own stamp in DIR
    VENV="$1" bash scripts/setup-engine.sh
    prune "$1"
}

ensure_env() {  # ensure_env LINK EXTRAS TORCH [LMCACHE]: reuse or build, link, install kvactors
    local link="$1" extras="$2" torch_version="$3" lmcache="${4:-}" dir
    dir="$STORE/${link#.}.$(env_key "${link#.}" "$extras" "$torch_version $lmcache")"
    in_store "$link" "$dir" build_env "$dir" "$extras" "$torch_version" "$lmcache"
    "$link/bin/python" -m pip install -q --no-deps --no-build-isolation -e .  # this checkout
}

setup_main() {
    timed ".venv (torch $TORCH_MAIN, lmcache 0.5.6)" \
        ensure_env .venv test,bench,metrics "$TORCH_MAIN" 0.5.6
}

setup_lmcache057_and_engine() {
    timed ".venv-lmcache057 (torch $TORCH_MAIN, lmcache 0.5.7rc2)" \
        ensure_env .venv-lmcache057 test "$TORCH_MAIN" 0.5.7rc2
    local dir
    dir="$STORE/venv-vllm.$(env_key vllm engine "$TORCH_MAIN")"
    timed ".venv-vllm (scripts/setup-engine.sh)" in_store .venv-vllm "$dir" build_engine "$dir"
}

setup_matrix() {
    local entry suffix version
    for entry in "${TORCH_MATRIX[@]}"; do
        read -r suffix version <<<"$entry"
        timed ".venv-$suffix (torch $version)" ensure_env ".venv-$suffix" test,metrics "$version"
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
    " ") timed ".venv (torch $TORCH_MAIN)" ensure_env .venv bench "$TORCH_MAIN" ;;
    *) echo "usage: bash scripts/setup.sh [--test [main|others] | --matrix]" >&2; exit 2 ;;
esac
