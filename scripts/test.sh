#!/usr/bin/env bash
# The whole test job: set up the venvs, lint (ruff check + format check), import contracts
# (import-linter), type-check (mypy), dead code (vulture), pytest.
# Exits non-zero on any failure, including "no tests collected".
#
# Two LMCache versions: the whole suite runs in .venv (lmcache 0.5.6); then the adapter tests
# (tests/adapters: unit, selection, gather/scatter, end to end against a real LMCache MP
# server, the differential tests) and the doctor tests run again in .venv-lmcache057
# (lmcache 0.5.7rc2). KVACTORS_EXPECT_LMCACHE makes each run check it has the version it
# is meant to test. KVACTORS_LMCACHE057=0 skips the second version (local iteration only).
#
# One fake vendor per process: torch names one private device per process, so the suites
# that run vendor code as written run once per vendor (scripts/test-fakes.sh), and the MLU
# differential test (LMCache's own MluDeviceOps exist from 0.5.7 on) runs under 0.5.7rc2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
PY=.venv/bin/python
PY057=.venv-lmcache057/bin/python
export LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0
echo "== ruff"
"$PY" -m ruff check .
echo "== ruff format --check (reported now, fails the job at the end)"
fmt=0
"$PY" -m ruff format --check . || fmt=1
echo "== import contracts (the floors of docs/architecture.md)"
.venv/bin/lint-imports
echo "== mypy (strict: kvactors/, adapters/; tests/ non-strict)"
"$PY" -m mypy
echo "== vulture (dead code: names only tests reach; reasons in vulture_whitelist.py)"
"$PY" -m vulture kvactors adapters examples scripts vulture_whitelist.py --min-confidence 60

run_pytest() {  # run_pytest LABEL PYTHON LMCACHE_VERSION [ENV=VALUE] ARGS...
    local label="$1" py="$2" version="$3" rc
    shift 3
    echo "== pytest ($label: lmcache $version)"
    set +e
    KVACTORS_EXPECT_LMCACHE="$version" "$py" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "pytest ($label) collected no tests: failing" >&2
        return 1
    fi
    return "$rc"
}

rc=0
run_pytest "whole suite" "$PY" 0.5.6 "$@" || rc=$?
for vendor in mlu musa; do
    KVACTORS_FAKE_VENDOR="$vendor" run_pytest "fake $vendor owns the device name" "$PY" 0.5.6 \
        -q -p no:cacheprovider $(bash scripts/test-fakes.sh --list) || rc=$?
done
if [ "${KVACTORS_LMCACHE057:-1}" != "0" ]; then
    run_pytest "adapter + doctor tests" "$PY057" 0.5.7rc2 \
        -p no:cacheprovider tests/adapters tests/cli/test_doctor.py || rc=$?
    KVACTORS_FAKE_VENDOR=mlu run_pytest "fake mlu owns the device name" "$PY057" 0.5.7rc2 \
        -q -p no:cacheprovider tests/adapters/test_differential_vendor.py \
        tests/adapters/test_lmcache_ops.py || rc=$?
fi
if [ "$rc" -eq 0 ] && [ "$fmt" -ne 0 ]; then
    echo "ruff format --check found files to reformat: run 'ruff format .'" >&2
    exit 1
fi
exit "$rc"
