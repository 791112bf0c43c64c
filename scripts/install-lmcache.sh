#!/usr/bin/env bash
# Install lmcache for kvactors' adapter on a host without CUDA (CPU, MLU, MUSA).
#
#   PYTHON=/path/to/venv/bin/python scripts/install-lmcache.sh                 # 0.5.6
#   PYTHON=/path/to/venv/bin/python LMCACHE_VERSION=0.5.7rc2 scripts/install-lmcache.sh
#
# The versions the adapter is tested against: 0.5.6 and the pre-release 0.5.7rc2 (CI runs the
# adapter tests on both; kvactors.doctor.LMCACHE_TESTED). The lmcache wheel declares CUDA-only
# requirements (cupy-cuda13x, cuda-python, cufile-python, nvtx), so it is installed with
# --no-deps (and --pre for a pre-release) and the modules its platform and multiprocess code
# import come from requirements/lmcache-deps.txt (0.5.6) or requirements/lmcache-057-deps.txt
# (0.5.7). The torch already installed is pinned as a constraint, so no step can swap it for
# another build. Idempotent: a second run changes nothing.
set -euo pipefail

PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"

case "$LMCACHE_VERSION" in
    0.5.6) DEPS="$HERE/requirements/lmcache-deps.txt"; PRE=() ;;
    0.5.7*) DEPS="$HERE/requirements/lmcache-057-deps.txt"; PRE=(--pre) ;;
    *) echo "install-lmcache.sh: lmcache ${LMCACHE_VERSION} is not a tested version" \
            "(0.5.6 or 0.5.7rc2)" >&2; exit 2 ;;
esac

"$PY" -m pip install ${PRE[@]+"${PRE[@]}"} --no-deps "lmcache==${LMCACHE_VERSION}"
"$PY" -m pip install -c "$CONSTRAINTS" -r "$DEPS"

LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0 "$PY" - <<'PYEOF'
import lmcache
import lmcache.v1.multiprocess.server  # noqa: F401
import lmcache.v1.multiprocess.transfer_context.worker_transfer  # noqa: F401
import lmcache.v1.multiprocess.transfer_context.base  # noqa: F401
import torch

import importlib.metadata

print(f"lmcache {importlib.metadata.version('lmcache')} at {lmcache.__file__} ok; "
      f"torch {torch.__version__}")
PYEOF
