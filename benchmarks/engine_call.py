"""One engine-shaped call taken apart: where kvactors' op spends its time, against LMCache's.

    .venv/bin/python benchmarks/engine_call.py [--calls 2000] [--before memory]

The operands of ``kvactors validate-serving --bench``'s engine, without the engine: vLLM's CPU
attention layout (format 12, ``[NB, NH, BS, 2*HS]`` per layer) for 2 layers in ONE allocation
(vLLM's ``LBHNC`` layout: a stacked view), 2 KV heads, packed width 64, blocks of 32, fp32;
each call moves 4 chunks of 64 tokens (8 blocks) with other block ids and other chunk buffers
(views of one host pool, as LMCache's) than the call before. Per direction it reports the
median time of: the kernel bound to the call's ids (``reused_kernel`` on a cached plan), the
plan cache's lookup, ``Runtime.transfer`` in all and the ``kvactors_cpu`` plugin's op in all,
each timed back to back; then the plugin's op and LMCache's own CPU op (``CpuDeviceOps``)
alternated ABBA, so each finds the other's traces in the caches, as in the engine's A/B.
``--nb`` sets the blocks per layer (the engine's pool is 32,768; its two layers one 1 GiB
allocation), ``--apart`` gives each layer an allocation of its own. One thread
(``torch.set_num_threads(1)``). ``--before memory`` copies 32 MiB before every timed
call, untimed: the caches start as cold as after an engine's forward pass.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

NL, NB, NH, BS, CS = 2, 256, 2, 32, 64  # layers, blocks, heads, block size, packed width
CHUNK, CHUNKS = 64, 4


def operands(
    nb: int = NB, apart: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor, list[Any]]:
    """The engine's paged layers (views of one allocation of ``nb`` blocks each, or with
    ``apart`` one allocation each), the host pool, and 64 calls' ``(block ids, chunk
    buffers)``: other ids and other views of the pool on every call."""
    page = NH * BS * CS
    if apart:
        layers = [torch.randn(nb * page).view(nb, NH, BS, CS) for _ in range(NL)]
    else:
        kv = torch.randn(NL * nb * page)  # [L, B, H, N, C], the layers one allocation
        layers = [kv[i * nb * page : (i + 1) * nb * page].view(nb, NH, BS, CS) for i in range(NL)]
    pool = torch.zeros(16 * CHUNKS, NL, CHUNK, NH * CS)
    rng = random.Random(0)
    calls = [
        (rng.sample(range(1, nb), CHUNKS * CHUNK // BS),
         [pool[(CHUNKS * k + j) % len(pool)] for j in range(CHUNKS)])
        for k in range(64)
    ]  # fmt: skip
    return layers, pool, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument(
        "--before", choices=("nothing", "memory"), default="nothing",
        help="memory: copy 32 MiB (untimed) before every timed call, as an engine's forward "
        "pass between two transfers evicts the caches",
    )  # fmt: skip
    ap.add_argument(
        "--nb", type=int, default=NB,
        help="blocks per layer (validate-serving's engine: 32768, its layers one 1 GiB allocation)",
    )  # fmt: skip
    ap.add_argument("--apart", action="store_true", help="each layer its own allocation")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import lmcache.lmcache_native as native
    from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps

    from kvactors.core.layouts import ShapeDesc
    from kvactors.core.plan_cache import PlanCache
    from kvactors.core.plans import TransferRequest
    from kvactors.kernels.fast import reused_kernel
    from kvactors.runtime import get_runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    page = NH * BS * CS
    layers, _, calls = operands(args.nb, args.apart)
    shape = ShapeDesc(
        kv_size=1, nl=NL, nb=args.nb, bs=BS, nh=NH, hs=CS, element_size=4,
        block_stride_elems=page, dtype="float32",
    )  # fmt: skip
    lm, kva = CpuDeviceOps(), KvactorsCpuOps()
    lm.ensure_native()
    fmt, cpu = native.EngineKVFormat(12), torch.device("cpu")

    def desc(ops: object) -> object:
        sd = ops.PageBufferShapeDesc()  # type: ignore[attr-defined]
        for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
            setattr(sd, f, getattr(shape, f))
        sd.dtype = torch.float32
        return sd

    descs = {"kvactors": desc(kva), "lmcache": desc(lm)}
    rt = get_runtime(backend="cpu", device_index=0)
    rows: dict[str, list[float]] = {}
    big = torch.ones(8 << 20)
    big_to = torch.empty_like(big)

    def evict() -> None:
        big_to.copy_(big)

    before = evict if args.before == "memory" else None
    for d in (1, 0):
        reqs = [
            TransferRequest(fmt=12, direction=d, block_ids=tuple(ids), chunk_size=CHUNK,
                            shape=shape)
            for ids, _ in calls
        ]  # fmt: skip
        cache = PlanCache("cpu", 0)
        found = [cache.lookup(r, layers, objs) for r, (_, objs) in zip(reqs, calls, strict=True)]
        memo = found[0].memo

        def kernel(i: int, found: Any = found, memo: Any = memo) -> None:
            reused_kernel(found[i].plan, layers, calls[i][1], memo)(layers, calls[i][1])

        def lookup(i: int, cache: Any = cache, reqs: Any = reqs) -> None:
            cache.lookup(reqs[i], layers, calls[i][1])

        def transfer(i: int, reqs: Any = reqs) -> None:
            rt.transfer(reqs[i], layers, calls[i][1])

        def op_alone(i: int, d: int = d) -> None:
            ids, objs = calls[i]
            kva.multi_layer_block_kv_transfer(
                layers, objs, ids, cpu, native.TransferDirection(d), descs["kvactors"], CHUNK,
                fmt, 0,
            )  # fmt: skip

        parts = {
            "kernel, bound to the ids": _median(kernel, args.calls, len(calls), before),
            "plan cache lookup": _median(lookup, args.calls, len(calls), before),
            "Runtime.transfer": _median(transfer, args.calls, len(calls), before),
            "kvactors op, back to back": _median(op_alone, args.calls, len(calls), before),
        }
        ops: dict[str, list[float]] = {"kvactors": [], "lmcache": []}
        for i in range(args.calls):
            who = ("kvactors", "lmcache", "lmcache", "kvactors")[i % 4]
            ids, objs = calls[i % len(calls)]
            op = (kva if who == "kvactors" else lm).multi_layer_block_kv_transfer
            if before is not None:
                before()
            t0 = time.perf_counter()
            op(layers, objs, ids, cpu, native.TransferDirection(d), descs[who], CHUNK, fmt, 0)
            ops[who].append(time.perf_counter() - t0)
        for who, ts in ops.items():
            parts[f"{who} op"] = statistics.median(ts[len(ts) // 10 :]) * 1e6
        for name, us in parts.items():
            rows.setdefault(name, []).append(us)
    print(f"{'us per call (median)':<28}{'store':>9}{'retrieve':>10}")
    for name, (store, retrieve) in rows.items():
        print(f"{name:<28}{store:>9.0f}{retrieve:>10.0f}")
    return 0


def _median(
    fn: Callable[[int], None], n: int, cycle: int, before: Callable[[], None] | None
) -> float:
    """Median microseconds of ``fn(i % cycle)`` over ``n`` calls (``before`` each, untimed),
    the first tenth dropped."""
    times = []
    for i in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn(i % cycle)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 10 :]) * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
