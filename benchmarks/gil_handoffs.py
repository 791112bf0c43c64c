"""Callers side by side on CPU: calls/s of 4 threads over 1, and what the process pays for it.

    .venv/bin/python benchmarks/gil_handoffs.py [--layout mla] [--direction gather] [--calls 1200]

One chunk of 256 bf16 tokens of the bench's small model (``kvactors.cli.bench._pools.Pool``)
per call, other block ids every call; ``kvactors`` is ``Runtime.transfer`` on CPU, ``torch``
the one ``index_select`` / ``index_copy_`` on the stacked pool making the same bytes. Each
contender runs ``--calls`` calls with 1 thread, then the same number split over 4 threads on
blocks apart. Per run: calls/s, the process's CPU time per call (user, system) and its
voluntary and involuntary context switches per call (``getrusage``). A voluntary switch is
mostly a thread waiting for the GIL (or a lock) after a torch call released it: the count
shows how often callers hand the GIL to each other. One torch thread. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from collections.abc import Callable


def _kvactors_call(rt: Any, pool: Any, c: int, gather: bool, n: int) -> Callable[[], object]:
    sets = pool.id_sets[c::n]
    req = pool.request(1 if gather else 0, sets[0])
    reqs = itertools.cycle([msgspec.structs.replace(req, block_ids=tuple(s)) for s in sets])
    objs = (pool.objects[c],)
    return lambda: rt.transfer(next(reqs), pool.paged, objs)


def _callers(rt: Any, pool: Any, who: str, gather: bool, n: int) -> list[Callable[[], object]]:
    """``n`` callers of ``who``, each on its own block sets (``[c::n]``) and chunk."""
    from kvactors.cli.bench.percall import _torch_call

    if who == "torch":
        return [_torch_call(pool, c, gather, n) for c in range(n)]
    return [_kvactors_call(rt, pool, c, gather, n) for c in range(n)]


def _run(fns: list[Callable[[], object]], calls: int) -> dict[str, float]:
    for fn in fns:  # warm: plans, bindings, every set once
        for _ in range(16):
            fn()
    each = calls // len(fns)

    def work(fn: Callable[[], object]) -> None:
        for _ in range(each):
            fn()

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    threads = [threading.Thread(target=work, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    n = each * len(fns)
    return {
        "calls_per_s": round(n / (t1 - t0)),
        "user_us": round((r1.ru_utime - r0.ru_utime) / n * 1e6, 1),
        "sys_us": round((r1.ru_stime - r0.ru_stime) / n * 1e6, 1),
        "voluntary_switches": round((r1.ru_nvcsw - r0.ru_nvcsw) / n, 2),
        "involuntary_switches": round((r1.ru_nivcsw - r0.ru_nivcsw) / n, 2),
    }


def measure(layout: str, direction: str, calls: int) -> dict[str, Any]:
    """Both contenders at 1 and 4 threads (see the module docstring)."""
    from kvactors.cli.bench._pools import Pool
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    gather = direction == "gather"
    out: dict[str, Any] = {"layout": layout, "direction": direction, "calls": calls}
    with Runtime("cpu", default_timeout=120.0) as rt:
        pool = Pool("small", layout, 256, 4)
        for who in ("torch", "kvactors"):
            one = _run(_callers(rt, pool, who, gather, 1), calls)
            four = _run(_callers(rt, pool, who, gather, 4), calls)
            out[who] = {
                "1": one,
                "4": four,
                "4/1": round(four["calls_per_s"] / one["calls_per_s"], 2),
            }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layout", default="mla", choices=["nhd", "hnd", "mla", "kv_list"])
    ap.add_argument("--direction", default="gather", choices=["gather", "scatter"])
    ap.add_argument("--calls", type=int, default=1200)
    a = ap.parse_args()
    print(json.dumps(measure(a.layout, a.direction, a.calls)))
