#!/usr/bin/env bash
# The fake-vendor suites once per vendor, each in its own pytest process.
#
#   bash scripts/test-fakes.sh [pytest args...]      (PYTHON=... to pick another venv)
#   bash scripts/test-fakes.sh --list                 (the suites, for scripts/test.sh)
#   bash scripts/test-fakes.sh --list-core            (those that need no lmcache: the torch
#                                                      version matrix runs them)
#
# torch can name one private device per process (rename_privateuse1_backend), so the fakes
# give real torch.device("mlu:0") / ("musa:0") objects to one vendor per process: the first
# fake installed claims the name, and KVACTORS_FAKE_VENDOR pins which kind may. A plain
# pytest run therefore exercises vendor code as written for one vendor only (tests needing
# the other skip with a reason); scripts/test.sh runs these suites under each vendor in turn.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CORE=(tests/testing tests/devices tests/runtime tests/scenarios)
SUITES=("${CORE[@]}" tests/adapters/vendors)
case "${1:-}" in
    --list) echo "${SUITES[@]}"; exit 0 ;;
    --list-core) echo "${CORE[@]}"; exit 0 ;;
esac
PY="${PYTHON:-.venv/bin/python}"
export LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0
rc=0
for vendor in mlu musa; do
    echo "== pytest with the fake ${vendor} owning torch's device name"
    KVACTORS_FAKE_VENDOR="$vendor" "$PY" -m pytest -q -p no:cacheprovider "${SUITES[@]}" "$@" || rc=$?
done
exit "$rc"
