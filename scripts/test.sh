#!/usr/bin/env bash
# The whole test job: set up the venvs, lint (ruff check + format check), import contracts
# (import-linter), type-check (mypy, also for Python 3.10), dead code (vulture), pytest, the
# torch version matrix and the vLLM engine test. Prints each phase's time and a summary.
# Exits non-zero on any failure, including "no tests collected". No C++ compiler is needed.
#
# Phases, cheapest and likeliest to fail first:
#   1. .venv (torch 2.13.0, lmcache 0.5.6); then the other venvs are built in the background
#      (scripts/setup.sh --test others: network and disk bound) while 2-4 run
#   2. ruff, ruff format --check, lint-imports, mypy (3.11 and 3.10), vulture
#   3. the whole suite in .venv (lmcache 0.5.6)
#   4. the fake-vendor suites once per fake vendor (scripts/test-fakes.sh): torch names one
#      private device per process, so each vendor's code runs as written in its own process
#   5. LMCache 0.5.7rc2 (.venv-lmcache057): the adapter and doctor tests, and the MLU
#      differential test (LMCache's own MluDeviceOps exist from 0.5.7 on)
#   6. the torch version matrix (.venv-torch24, .venv-torch25; scripts/setup.sh --matrix): on
#      each, the suite without tests/adapters, tests/engine and the tests marked lmcache (no
#      lmcache there), the fake-vendor suites for both
#      vendors, `kvactors selftest --device mlu|musa --fake` and `kvactors demo`. The LMCache
#      adapter tests stay on torch 2.13: LMCache's native extension is built per torch
#   7. the vLLM engine test and the deployment tests (tests/engine in .venv-vllm: vllm serve
#      against native prefix caching, a concurrent load against LMCache's own op, two engines
#      on one LMCache server, Redis L2 across a server restart, lost L2 keys; servers on
#      loopback, started and stopped by the tests; redis-server from scripts/setup-engine.sh)
#
# KVACTORS_EXPECT_LMCACHE makes each adapter run check it has the LMCache version it is meant
# to test. Local iteration only: KVACTORS_LMCACHE057=0 skips phase 5, KVACTORS_MATRIX=0 phase 6,
# KVACTORS_ENGINE=0 phase 7 (and the venvs they need are still built).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0
PY=.venv/bin/python
PY057=.venv-lmcache057/bin/python
START=$SECONDS
SUMMARY=()
SETUP_PID=""
SETUP_LOG="$(mktemp)"

summary() {
    if [ -n "$SETUP_PID" ]; then  # an early exit: stop the background set-up we started
        kill -- "-$SETUP_PID" 2>/dev/null || true
    fi
    rm -f "$SETUP_LOG"
    echo "== phases (seconds, status):"
    printf '  %s\n' "${SUMMARY[@]}"
    echo "== total $((SECONDS - START)) s"
}
trap summary EXIT

step() {  # step NAME COMMAND...: runs it, records its time and status, returns its status
    local name="$1" begin=$SECONDS rc=0
    shift
    echo "== [+$((SECONDS - START)) s] $name"
    "$@" || rc=$?
    SUMMARY+=("$(printf '%5d  %-4s  %s' $((SECONDS - begin)) \
        "$([ "$rc" -eq 0 ] && echo ok || echo FAIL)" "$name")")
    return "$rc"
}

run_pytest() {  # run_pytest PYTHON ARGS...: pytest, and "no tests collected" fails
    local py="$1" rc=0
    shift
    "$py" -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests: failing" >&2
        return 1
    fi
    return "$rc"
}

expect_torch() {  # expect_torch PYTHON VERSION: the venv has the torch it is meant to test
    "$1" -c 'import sys, torch
v = torch.__version__.split("+")[0]
sys.exit(0 if v == sys.argv[1] else f"torch {v} installed, the matrix expects {sys.argv[1]}")' "$2"
}

# The venvs below take about 18 GB (two torch matrix venvs of 5.4 GB with their CUDA
# libraries, the vLLM venv 3.7 GB, two of 1.5 GB): say so up front, not as ENOSPC later.
NEED_GB=20
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
echo "== disk: ${free_gb} GB free here; the test job's venvs take about ${NEED_GB} GB"
if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "== warning: less free disk than the venvs need; setup may fail with ENOSPC" >&2
fi
step "setup: .venv (scripts/setup.sh --test main)" bash scripts/setup.sh --test main
echo "== [+$((SECONDS - START)) s] setup of the other venvs starts in the background"
set -m  # its own process group, so an early exit can stop all of it
bash scripts/setup.sh --test others >"$SETUP_LOG" 2>&1 &
SETUP_PID=$!
set +m

step "ruff check" "$PY" -m ruff check .
fmt=0
step "ruff format --check (fails the job at the end)" "$PY" -m ruff format --check . || fmt=1
step "import contracts (lint-imports)" .venv/bin/lint-imports
step "mypy (strict: kvactors/, adapters/; tests/ non-strict)" "$PY" -m mypy
step "mypy --python-version 3.10 (kvactors/, adapters/)" "$PY" -m mypy --python-version 3.10 \
    kvactors adapters/kvactors_lmcache
step "vulture (dead code; reasons in vulture_whitelist.py)" "$PY" -m vulture kvactors adapters \
    examples scripts vulture_whitelist.py --min-confidence 60

rc=0
KVACTORS_EXPECT_LMCACHE=0.5.6 step "pytest: whole suite (torch 2.13, lmcache 0.5.6)" \
    run_pytest "$PY" --ignore=tests/engine "$@" || rc=$?
for vendor in mlu musa; do
    KVACTORS_FAKE_VENDOR="$vendor" step "pytest: fake $vendor suites (torch 2.13)" \
        run_pytest "$PY" -q -p no:cacheprovider $(bash scripts/test-fakes.sh --list) || rc=$?
done

setup_rc=0
step "setup: the other venvs (background, waited for)" wait "$SETUP_PID" || setup_rc=$?
SETUP_PID=""
cat "$SETUP_LOG"
if [ "$setup_rc" -ne 0 ]; then
    echo "scripts/setup.sh --test others failed (exit $setup_rc): see above" >&2
    exit 1
fi

if [ "${KVACTORS_LMCACHE057:-1}" != "0" ]; then
    KVACTORS_EXPECT_LMCACHE=0.5.7rc2 step "pytest: adapter + doctor tests (lmcache 0.5.7rc2)" \
        run_pytest "$PY057" -p no:cacheprovider tests/adapters tests/cli/test_doctor.py || rc=$?
    KVACTORS_EXPECT_LMCACHE=0.5.7rc2 KVACTORS_FAKE_VENDOR=mlu \
        step "pytest: fake mlu differential (lmcache 0.5.7rc2)" \
        run_pytest "$PY057" -q -p no:cacheprovider tests/adapters/test_differential_vendor.py \
        tests/adapters/test_lmcache_ops.py || rc=$?
fi

if [ "${KVACTORS_MATRIX:-1}" != "0" ]; then
    while read -r suffix version; do
        venv=".venv-$suffix"
        step "torch $version: $venv has it" expect_torch "$venv/bin/python" "$version" || rc=$?
        step "torch $version: pytest without tests/adapters" run_pytest "$venv/bin/python" \
            -q -p no:cacheprovider --ignore=tests/adapters --ignore=tests/engine \
            -m "not lmcache" || rc=$?
        for vendor in mlu musa; do
            KVACTORS_FAKE_VENDOR="$vendor" step "torch $version: pytest fake $vendor suites" \
                run_pytest "$venv/bin/python" -q -p no:cacheprovider \
                $(bash scripts/test-fakes.sh --list-core) || rc=$?
            step "torch $version: kvactors selftest --device $vendor --fake" \
                "$venv/bin/kvactors" selftest --device "$vendor" --fake || rc=$?
        done
        step "torch $version: kvactors demo" "$venv/bin/kvactors" demo || rc=$?
    done < <(bash scripts/setup.sh --matrix)
fi

if [ "${KVACTORS_ENGINE:-1}" != "0" ] && [ -d tests/engine ]; then
    step "pytest: vLLM engine and deployment tests (.venv-vllm)" \
        run_pytest .venv-vllm/bin/python -p no:cacheprovider --durations=0 tests/engine || rc=$?
fi

if [ "$rc" -eq 0 ] && [ "$fmt" -ne 0 ]; then
    echo "ruff format --check found files to reformat: run 'ruff format .'" >&2
    exit 1
fi
exit "$rc"
