"""GB/s per layout and direction through :class:`~kvactors.runtime.Runtime` against a raw
contiguous copy of the same bytes and (on CPU) LMCache's torch path on the same operands: 4
chunks of 256 tokens a call, each call timed with a device synchronize after it.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

import msgspec
import torch

from kvactors.cli.bench._harness import Lane, baseline, rates, table
from kvactors.cli.bench._pools import Pool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.cli._devenv import DeviceEnv

__all__ = ("TransferRow", "format_transfer", "run_transfer")


class TransferRow(msgspec.Struct, frozen=True, kw_only=True):
    """One layout x direction on one device: GB/s per contender (``kvactors``, ``raw``,
    ``lmcache`` where measured)."""

    device: str
    simulated: bool
    layout: str
    direction: str
    nbytes: int
    reps: int
    gbps: dict[str, float]


def run_transfer(
    env: DeviceEnv,
    layouts: Sequence[str],
    *,
    reps: int = 15,
    blocks: int = 1024,
    model: str = "8b",
    progress: Callable[[str], None] | None = None,
) -> list[TransferRow]:
    """Measure both directions of each layout on ``env``'s device (one torch thread; ``model``
    one of :data:`~kvactors.cli.bench._pools.MODELS`)."""
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    make_lmcache = baseline("lmcache_torch") if env.kind == "cpu" else None
    rows: list[TransferRow] = []
    with Runtime(env.backend(), default_timeout=120.0) as rt:
        for layout in layouts:
            pool = Pool(model, layout, blocks, 4, zeros=lambda s: env.zeros(s, torch.bfloat16))
            ids = random.Random(0).sample(range(blocks), 4 * pool.bpo)
            nbytes = sum(o.nbytes for o in pool.objects)
            host = torch.ones(nbytes // 2, dtype=torch.bfloat16)
            dev = env.to_device(torch.ones(nbytes // 2, dtype=torch.bfloat16))
            for d in ("gather", "scatter"):
                req = pool.request(1 if d == "gather" else 0, ids)
                src, dst = (dev, host) if d == "gather" else (host, dev)
                fns: dict[str, Callable[[], object]] = {
                    "kvactors": functools.partial(rt.transfer, req, pool.paged, pool.objects),
                    "raw": functools.partial(dst.copy_, src),
                }
                if make_lmcache is not None:
                    try:
                        fns["lmcache"] = make_lmcache(req, pool.paged, pool.objects)
                    except ImportError:  # the adapter is installed but lmcache is not
                        make_lmcache = None
                lanes = {k: [Lane([("call", fn)], done=env.synchronize)] for k, fn in fns.items()}
                got = rates(lanes, 1, reps)
                gbps = {k: nbytes * t.calls_per_s / 1e9 for k, t in got.items()}
                row = TransferRow(
                    device=env.kind,
                    simulated=env.simulated,
                    layout=layout,
                    direction=d,
                    nbytes=nbytes,
                    reps=reps,
                    gbps=gbps,
                )
                rows.append(row)
                if progress is not None:
                    progress(f"transfer {layout} {d}")
            del pool, host, dev
    return rows


def format_transfer(rows: Sequence[TransferRow]) -> str:
    """The rows as a text table (GB/s; ``vs``: kvactors' GB/s over the other's)."""
    sim = " (SIMULATED: compare contenders, not GB/s)" if any(r.simulated for r in rows) else ""
    head = ("device", "layout", "dir", "MiB", "kvactors", "raw", "lmcache", "vs raw", "vs lmc")
    g = [(r, r.gbps["kvactors"], r.gbps["raw"], r.gbps.get("lmcache")) for r in rows]
    return table(
        f"GB/s through the runtime{sim}",
        head,
        ((r.device, r.layout, r.direction, r.nbytes >> 20, k, raw, lm or "-", k / raw,
          k / lm if lm else "-") for r, k, raw, lm in g),
    )  # fmt: skip
