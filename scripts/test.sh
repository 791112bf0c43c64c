#!/usr/bin/env bash
# The whole test job: set up the venvs, lint (ruff), type-check (mypy strict on kvactors/),
# pytest. Exits non-zero on any failure, including "no tests collected".
#
# Two LMCache versions: the whole suite runs in .venv (lmcache 0.5.6); then the adapter tests
# (tests/adapters: unit, selection, gather/scatter, end to end against a real LMCache MP
# server, the differential tests) and the doctor tests run again in .venv-lmcache057
# (lmcache 0.5.7rc2). KVACTORS_EXPECT_LMCACHE makes each run check it has the version it
# is meant to test. KVACTORS_LMCACHE057=0 skips the second run (local iteration only).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
PY=.venv/bin/python
export LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0
echo "== ruff"
"$PY" -m ruff check .
echo "== mypy (strict, kvactors/)"
"$PY" -m mypy

run_pytest() {  # run_pytest LABEL PYTHON LMCACHE_VERSION ARGS...
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
if [ "${KVACTORS_LMCACHE057:-1}" != "0" ]; then
    run_pytest "adapter + doctor tests" .venv-lmcache057/bin/python 0.5.7rc2 \
        -p no:cacheprovider tests/adapters tests/cli/test_doctor.py || rc=$?
fi
exit "$rc"
