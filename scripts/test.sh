#!/usr/bin/env bash
# The whole test job: set up the venvs, the static checks, one pytest process per (venv, fake
# vendor), the torch floor lane and the vLLM engine tests. Every phase prints its time beside
# its budget; the job ends with the phases over budget (a warning, not a failure), the free
# disk at start and end, and what the job added. Exits non-zero on any failure, including "no
# tests collected". No C++ compiler is needed.
#
# Tests are selected by directory (tests/<floor>/, tests/meta/meta tests the tree itself):
#   .venv (torch 2.13, lmcache 0.5.6), fake mlu     the whole suite but tests/engine
#   .venv, fake musa                                the vendor-facing directories (VENDOR_DIRS):
#                                                   torch names one private device per process,
#                                                   so each vendor's code runs as written in its
#                                                   own process
#   .venv-lmcache057 (lmcache 0.5.7rc2), fake mlu   tests/adapters and the doctor's tests,
#                                                   LMCache 0.5.7rc2's own MLU device suite
#   .venv-lmcache057, fake musa                     tests/adapters/vendors (against 0.5.7's
#                                                   own MUSA ops), LMCache 0.5.7rc2's own
#                                                   MUSA device suite
# (LMCache's own device suites: tests/testing/test_lmcache_device_suites.py, one child pytest
# per (venv, vendor), from the sdists scripts/fetch-lmcache-sdists.sh caches; LMCache 0.5.6
# ships only a MUSA suite, run by the .venv fake musa phase.)
#   .venv-torch27 (torch 2.7.1), fake mlu and musa  the torch-facing directories (TORCH_DIRS,
#                                                   VENDOR_CORE; no lmcache there), both fake
#                                                   selftests and the demo
#   .venv-vllm                                      tests/engine: vllm serve against native
#                                                   prefix caching, TP=2, a shared server, Redis
#                                                   L2, a 3-master Redis Cluster L2 with a master
#                                                   lost and back (servers on loopback, started
#                                                   by the tests)
# The venvs other than .venv are built (or reused from the store of scripts/setup.sh) in the
# background while the static checks and the first suite run.
#
# KVACTORS_EXPECT_LMCACHE makes each adapter run check it has the LMCache version it is meant
# to test. Local iteration only: KVACTORS_LMCACHE057=0 skips the 0.5.7rc2 phase,
# KVACTORS_MATRIX=0 the torch floor lane, KVACTORS_ENGINE=0 the engine phase (the venvs they
# need are still built).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0
PY=.venv/bin/python
PY057=.venv-lmcache057/bin/python
STORE="${KVACTORS_VENV_STORE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kvactors/venvs}"
# The directories whose tests touch torch's API (run again on the torch floor) and those that
# drive a fake vendor's device code (run again under the second fake vendor).
TORCH_DIRS=(tests/core tests/kernels tests/devices tests/testing tests/actors tests/runtime
    tests/observe tests/scenarios)
VENDOR_CORE=(tests/devices tests/testing tests/actors tests/runtime tests/scenarios)
VENDOR_DIRS=("${VENDOR_CORE[@]}" tests/adapters/vendors)
# LMCache's own device suite of the venv's LMCache version for the phase's fake vendor (in
# tests/testing, so the .venv phases run it already; the 0.5.7rc2 phases name it).
LMCACHE_SUITES=tests/testing/test_lmcache_device_suites.py
PYTEST=(-p no:cacheprovider --durations=15)
START=$SECONDS
SUMMARY=()
OVER=()
SETUP_PID=""
SETUP_LOG="$(mktemp)"

free_kb() { df -Pk . | awk 'NR == 2 { print $4 }'; }
FREE_START=$(free_kb)

summary() {
    if [ -n "$SETUP_PID" ]; then  # an early exit: stop the background set-up we started
        kill -- "-$SETUP_PID" 2>/dev/null || true
    fi
    rm -f "$SETUP_LOG"
    local free_end
    free_end=$(free_kb)
    echo "== phases (seconds / budget, status):"
    printf '  %s\n' "${SUMMARY[@]}"
    if [ "${#OVER[@]}" -gt 0 ]; then
        echo "== warning: phases over budget:"
        printf '  %s\n' "${OVER[@]}"
    else
        echo "== every phase within its budget"
    fi
    echo "== disk: $((FREE_START / 1048576)) GB free at start, $((free_end / 1048576)) GB at" \
        "end; the job added $(((FREE_START - free_end) / 1024)) MB" \
        "(venv store $STORE: $(du -sh "$STORE" 2>/dev/null | cut -f1))"
    echo "== total $((SECONDS - START)) s"
}
trap summary EXIT

step() {  # step BUDGET NAME COMMAND...: runs it, records its time and status, returns its status
    local budget="$1" name="$2" begin=$SECONDS rc=0 took
    shift 2
    echo "== [+$((SECONDS - START)) s] $name (budget ${budget} s)"
    "$@" || rc=$?
    took=$((SECONDS - begin))
    SUMMARY+=("$(printf '%5d / %4d  %-4s  %s' "$took" "$budget" \
        "$([ "$rc" -eq 0 ] && echo ok || echo FAIL)" "$name")")
    if [ "$took" -gt "$budget" ]; then
        OVER+=("$name: ${took} s, budget ${budget} s")
    fi
    return "$rc"
}

run_pytest() {  # run_pytest PYTHON ARGS...: pytest, and "no tests collected" fails
    local py="$1" rc=0
    shift
    "$py" -m pytest "${PYTEST[@]}" "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests: failing" >&2
        return 1
    fi
    return "$rc"
}

expect_torch() {  # expect_torch PYTHON VERSION: the venv has the torch it is meant to test
    "$1" -c 'import sys, torch
v = torch.__version__.split("+")[0]
sys.exit(0 if v == sys.argv[1] else f"torch {v} installed, the lane expects {sys.argv[1]}")' "$2"
}

echo "== disk: $((FREE_START / 1048576)) GB free; a first set-up of the venvs takes about 12 GB" \
    "in $STORE (reused afterwards)"
step 120 "setup: .venv (scripts/setup.sh --test main)" bash scripts/setup.sh --test main
echo "== [+$((SECONDS - START)) s] setup of the other venvs starts in the background"
set -m  # its own process group, so an early exit can stop all of it
bash scripts/setup.sh --test others >"$SETUP_LOG" 2>&1 &
SETUP_PID=$!
set +m

step 5 "ruff check" "$PY" -m ruff check .
fmt=0
step 5 "ruff format --check (fails the job at the end)" "$PY" -m ruff format --check . || fmt=1
step 15 "import contracts (lint-imports)" .venv/bin/lint-imports
step 45 "mypy (as Python 3.10: strict on kvactors/, adapters/, tools/; tests/ non-strict)" \
    "$PY" -m mypy
step 15 "vulture (dead code; reasons in vulture_whitelist.py)" "$PY" -m vulture kvactors adapters \
    tools examples scripts vulture_whitelist.py --min-confidence 60

rc=0
# LMCache's own device suites (tests/testing/test_lmcache_device_suites.py) run from its
# sdists: fetched once into a cache beside the venv store (not part of any venv's key); with
# the variable set, a missing sdist fails that test instead of skipping it.
export KVACTORS_LMCACHE_SDISTS="${KVACTORS_LMCACHE_SDISTS:-$(dirname "$STORE")/lmcache-sdists}"
step 30 "LMCache sdists for its device suites (scripts/fetch-lmcache-sdists.sh)" \
    bash scripts/fetch-lmcache-sdists.sh || rc=$?
KVACTORS_EXPECT_LMCACHE=0.5.6 KVACTORS_FAKE_VENDOR=mlu \
    step 330 "pytest: whole suite, fake mlu (torch 2.13, lmcache 0.5.6)" \
    run_pytest "$PY" --ignore=tests/engine "$@" || rc=$?
KVACTORS_EXPECT_LMCACHE=0.5.6 KVACTORS_FAKE_VENDOR=musa \
    step 75 "pytest: vendor-facing directories, fake musa (torch 2.13)" \
    run_pytest "$PY" -q "${VENDOR_DIRS[@]}" || rc=$?

setup_rc=0
step 60 "setup: the other venvs (background, waited for)" wait "$SETUP_PID" || setup_rc=$?
SETUP_PID=""
grep -v "^WARNING: Location" "$SETUP_LOG" || true
if [ "$setup_rc" -ne 0 ]; then
    echo "scripts/setup.sh --test others failed (exit $setup_rc): see above" >&2
    exit 1
fi

if [ "${KVACTORS_LMCACHE057:-1}" != "0" ]; then
    KVACTORS_EXPECT_LMCACHE=0.5.7rc2 KVACTORS_FAKE_VENDOR=mlu \
        step 145 "pytest: adapters + doctor + LMCache's MLU suite, fake mlu (lmcache 0.5.7rc2)" \
        run_pytest "$PY057" -q tests/adapters tests/cli/test_doctor.py "$LMCACHE_SUITES" \
        || rc=$?
    KVACTORS_EXPECT_LMCACHE=0.5.7rc2 KVACTORS_FAKE_VENDOR=musa \
        step 45 "pytest: adapters/vendors + LMCache's MUSA suite, fake musa (lmcache 0.5.7rc2)" \
        run_pytest "$PY057" -q tests/adapters/vendors "$LMCACHE_SUITES" || rc=$?
fi

if [ "${KVACTORS_MATRIX:-1}" != "0" ]; then
    while read -r suffix version; do
        venv=".venv-$suffix"
        step 5 "torch $version: $venv has it" expect_torch "$venv/bin/python" "$version" || rc=$?
        KVACTORS_FAKE_VENDOR=mlu step 90 "torch $version: torch-facing directories, fake mlu" \
            run_pytest "$venv/bin/python" -q -m "not lmcache" "${TORCH_DIRS[@]}" || rc=$?
        KVACTORS_FAKE_VENDOR=musa step 60 "torch $version: vendor-facing directories, fake musa" \
            run_pytest "$venv/bin/python" -q -m "not lmcache" \
            "${VENDOR_CORE[@]}" || rc=$?
        for vendor in mlu musa; do
            step 20 "torch $version: kvactors selftest --device $vendor --fake" \
                "$venv/bin/kvactors" selftest --device "$vendor" --fake || rc=$?
        done
        step 20 "torch $version: kvactors demo" "$venv/bin/kvactors" demo || rc=$?
    done < <(bash scripts/setup.sh --matrix)
fi

if [ "${KVACTORS_ENGINE:-1}" != "0" ] && [ -d tests/engine ]; then
    step 600 "pytest: vLLM engine and deployment tests (.venv-vllm)" \
        run_pytest .venv-vllm/bin/python tests/engine || rc=$?
fi

if [ "$rc" -eq 0 ] && [ "$fmt" -ne 0 ]; then
    echo "ruff format --check found files to reformat: run 'ruff format .'" >&2
    exit 1
fi
exit "$rc"
