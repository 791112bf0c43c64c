#!/usr/bin/env bash
# Install lmcache 0.5.6 for kvactors' adapter on a host without CUDA (CPU, MLU, MUSA).
#
#   PYTHON=/path/to/venv/bin/python scripts/install-lmcache.sh
#
# The lmcache wheel declares CUDA-only requirements (cupy-cuda13x, cuda-python, cufile-python,
# nvtx), so it is installed with --no-deps and the modules its platform and multiprocess code
# import come from requirements/lmcache-deps.txt. The torch already installed is pinned as a
# constraint, so no step can swap it for another build. Idempotent: a second run changes nothing.
set -euo pipefail

PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"

"$PY" -m pip install --no-deps "lmcache==${LMCACHE_VERSION}"
"$PY" -m pip install -c "$CONSTRAINTS" -r "$HERE/requirements/lmcache-deps.txt"

LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0 "$PY" - <<'PYEOF'
import lmcache
import lmcache.v1.multiprocess.server  # noqa: F401
import lmcache.v1.multiprocess.transfer_context.worker_transfer  # noqa: F401
import torch

print(f"lmcache {lmcache.__file__} ok; torch {torch.__version__}")
PYEOF
