#!/usr/bin/env bash
# One prepared run of kvactors on a lent NVIDIA GPU (H100 or H200), about 3-5 minutes (the
# steps' limits add up to 9 minutes, inside the device tool's 10):
#   1. `kvactors selftest --device cuda` (correctness on real streams),
#   2. scripts/gpu_check.py (the ordering checks and 1 GiB pinned copies),
#   3. `kvactors bench --device cuda --no-percall --no-vendor` (issue 41's one-chunk calls:
#      NHD, HND, MLA, K/V lists, NHD per-layer allocations; 32 layers, a 4096-block pool,
#      pinned 256-token chunks, 1 and 4 callers on their own streams, raw copies and the bare
#      torch route in the same run, CUDA events, busy time behind a spin kernel).
# Everything lands in $OUT (at most 8 files come back): env.txt, selftest.txt, selftest.json,
# gpu_check.txt, bench.txt, bench.json.
#
# The machine has Python 3.12 and its own torch (2.11+cu130 when last seen) but no msgspec and
# no network: carry msgspec as a wheel. Once, here, in the repository root (.whl/ is ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0
# then call the device tool's run with command "bash scripts/device-run.sh", carry [".whl"],
# timeout_s 600. Commit first: the commit is recorded in env.txt when .git travels.
#
# Rehearsal here, on CPU (small operands, the same steps):
#   OUT=/tmp/device-out PY=.venv/bin/python bash scripts/device-run.sh cpu
set -u -o pipefail
device=${1:-cuda}
OUT=${OUT:-device-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LMCACHE_TRACK_USAGE=false
if ! $PY -c 'import msgspec' 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvactors-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvactors-site:$PYTHONPATH
fi
quick=()
[ "$device" = cpu ] && quick=(--quick)
status=0

{
    date -u
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi 2>&1 | head -15
    $PY -c 'import sys, torch, msgspec; print(sys.version); print("torch", torch.__version__, "msgspec", msgspec.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step() {  # step NAME SECONDS CMD...: run one step under a time limit, its output in NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" = 0 ] || status=1
}

step selftest 120 $PY -m kvactors.cli selftest --device "$device" --json "$OUT/selftest.json"
if [ "$device" = cuda ]; then
    step gpu_check 90 $PY scripts/gpu_check.py --mib 1024 --iters 10
fi
step bench 330 $PY -m kvactors.cli bench --device "$device" "${quick[@]}" --no-percall \
    --no-vendor --no-plot --out "$OUT"
# Every case measured and bit-exact, or the run says which was not.
$PY - "$OUT/bench.json" <<'PYEOF' || status=1
import json, sys
rows = json.load(open(sys.argv[1]))["transfer"]
bad = [f"{r['layout']} {r['direction']}: {r['error'] or 'not exact'}" for r in rows
       if r["error"] or r["exact"] is not True]
print("bench cases:", len(rows), "measured and exact:", len(rows) - len(bad))
print("\n".join(bad))
sys.exit(1 if bad or not rows else 0)
PYEOF
echo "device-run: $([ $status = 0 ] && echo all steps passed || echo a step FAILED)"
exit $status
