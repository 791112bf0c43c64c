"""Python frames and profile events of one steady-state engine-shaped call: kvactors' op
against LMCache's own CPU op, in one process.

    .venv/bin/python benchmarks/call_footprint.py [--calls 64]     # prints one JSON line

The call shape of ``kvactors validate-serving --bench``'s engine (``benchmarks/engine_call.py``):
vLLM's CPU attention layout (format 12, ``[NB, NH, BS, 2*HS]`` per layer), 2 layers in one
allocation, 2 heads, packed width 64, blocks of 32, fp32; 4 chunks of 64 tokens a call, other
block ids and other chunk buffers on every call (64 sets cycled). After two warm cycles of
both ops, ``--calls`` calls of each run under ``sys.setprofile`` (the garbage collector off, so
no finalizer runs inside the window). Per call: ``frames`` = ``call`` events (Python frames,
generator resumes included), ``events`` = ``call`` + ``c_call`` events (every Python and C
call; the return events mirror them), ``torch_calls`` = the ``c_call`` events of torch's own
functions and tensor methods (each dispatched torch call releases the GIL, which callers side
by side then queue for), the loop's own events subtracted (an empty call measured the same
way). Events on other threads in the window (profiled from their start) are counted
apart as ``other_threads``. Counts, not times: the same on every run. The metrics mirror is
off (``KVACTORS_METRICS=off``): its thread's timed passes are no call's work, and would land in
a window or not by the clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
from collections import Counter
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ["KVACTORS_METRICS"] = "off"

SETS = 64  # the call sets of engine_call.operands(), cycled

_active = [False]
_others: Counter[str] = Counter()


def _other_thread(frame: Any, event: str, arg: Any) -> None:
    if _active[0]:
        _others[event] += 1


threading.setprofile(_other_thread)  # every thread started from here on (the runtime's)


def _is_torch(fn: Any) -> bool:
    """Whether a builtin is torch's: a function of a torch module or a tensor's method."""
    import torch

    owner = getattr(fn, "__self__", None)
    return isinstance(owner, torch.Tensor) or str(getattr(fn, "__module__", "")).startswith("torch")


def _count(fn: Any, n: int) -> tuple[Counter[str], Counter[str]]:
    """Profile events of ``fn(i)`` for i in range(n): this thread's and other threads'."""
    mine: Counter[str] = Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        mine[event] += 1
        if event == "c_call" and _is_torch(arg):
            mine["torch"] += 1

    _others.clear()
    gc.collect()
    gc.disable()
    try:
        _active[0] = True
        sys.setprofile(prof)
        for i in range(n):
            fn(i)
        sys.setprofile(None)
        _active[0] = False
    finally:
        gc.enable()
    return mine, Counter(_others)


def measure(calls: int = SETS) -> dict[str, Any]:
    """The counts per call of both ops in both directions (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    import lmcache.lmcache_native as native
    from engine_call import BS, CHUNK, CS, NB, NH, NL, operands
    from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps

    from kvactors_lmcache.ops import KvactorsCpuOps

    page = NH * BS * CS
    layers, pool, sets = operands()
    ops = {"kvactors": KvactorsCpuOps(), "lmcache": CpuDeviceOps()}
    ops["lmcache"].ensure_native()
    fmt, cpu = native.EngineKVFormat(12), torch.device("cpu")

    def op_call(who: str, d: int) -> Any:
        op, direction = ops[who], native.TransferDirection(d)
        sd = op.PageBufferShapeDesc()
        sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 1, NL, NB, BS, NH, CS
        sd.element_size, sd.block_stride_elems, sd.dtype = 4, page, torch.float32
        call = op.multi_layer_block_kv_transfer

        def fn(i: int) -> None:
            ids, objs = sets[i % SETS]
            call(layers, objs, ids, cpu, direction, sd, CHUNK, fmt, 0)

        return fn

    out: dict[str, Any] = {"calls": calls}
    for dname, d in (("store", 1), ("retrieve", 0)):
        fns = {who: op_call(who, d) for who in ops}
        for _ in range(2):  # warm: plans, caches, every set seen
            for fn in fns.values():
                for i in range(SETS):
                    fn(i)
        empty, _ = _count(lambda i: None, calls)
        for who, fn in fns.items():
            mine, others = _count(fn, calls)
            frames = (mine["call"] - empty["call"]) / calls
            events = (mine["call"] + mine["c_call"] - empty["call"] - empty["c_call"]) / calls
            other = (others["call"] + others["c_call"]) / calls
            out[f"{who}_{dname}"] = {
                "frames": frames,
                "events": events,
                "torch_calls": (mine["torch"] - empty["torch"]) / calls,
                "other_threads": other,
            }
    # The counted calls do the work: both ops store the same (nonzero) bytes for one call.
    stored = []
    for who in ops:
        pool.zero_()
        op_call(who, 1)(0)
        stored.append(pool.clone())
    out["same_bytes"] = bool(stored[0].abs().sum() > 0) and torch.equal(*stored)
    return out


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    sys.path[1:1] = [os.path.join(sys.path[0], "adapters")]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--calls", type=int, default=SETS)
    print(json.dumps(measure(ap.parse_args().calls)))
