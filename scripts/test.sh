#!/usr/bin/env bash
# The whole test job: set up .venv, lint (ruff check + format check), import contracts
# (import-linter), type-check (mypy), dead code (vulture), pytest.
# Exits non-zero on any failure, including "no tests collected".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --test
PY=.venv/bin/python
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
echo "== pytest"
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
if [ "$rc" -eq 0 ] && [ "$fmt" -ne 0 ]; then
    echo "ruff format --check found files to reformat: run 'ruff format .'" >&2
    exit 1
fi
exit "$rc"
