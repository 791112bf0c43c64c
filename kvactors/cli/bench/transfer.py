"""Transfer benchmark: kvactors' fast path vs a raw copy and LMCache, in the same run.

Per layout and direction, kvactors (a fresh request and a ``reused`` plan), a raw contiguous
``copy_`` of the same bytes and, through the ``kvactors.baselines`` entry points, LMCache's
torch path on the identical operands run interleaved; figures are ratios of medians from one
run. Pools are touched before timing. Run ``python -m kvactors.cli.bench.transfer --help``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat, ShapeDesc
from kvactors.core.plan_cache import KernelMemo, PlanCache
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.errors import InvalidSettingError
from kvactors.kernels.fast import ScratchCache, reused_kernel, run_fast

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ("LAYOUTS", "BenchRow", "BenchWorkload", "format_table", "main", "run_transfer_bench")

LAYOUTS = ("nhd", "hnd", "mla", "kv_list", "nhd_separate")
"""Benchmarked layouts: NHD (format 1), HND (6), MLA (3), K/V lists (9), and NHD with every
layer allocated separately."""

_FORMATS = {
    "nhd": KVFormat.NL_X_TWO_NB_BS_NH_HS,
    "hnd": KVFormat.NL_X_TWO_NB_NH_BS_HS,
    "mla": KVFormat.NL_X_NB_BS_HS,
    "kv_list": KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
    "nhd_separate": KVFormat.NL_X_TWO_NB_BS_NH_HS,
}


class BenchWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """The benchmark's shape (defaults: a Llama-8B-like cache; MLA uses ``mla_hs``)."""

    num_layers: int = 32
    block_size: int = 16
    num_heads: int = 8
    head_size: int = 128
    mla_hs: int = 576
    chunk_tokens: int = 256
    chunks_per_call: int = 4
    num_blocks: int = 1024
    dtype: str = "bfloat16"


class BenchRow(msgspec.Struct, frozen=True, kw_only=True):
    """One layout x direction x thread-count result (medians of interleaved repetitions)."""

    layout: str
    direction: str
    threads: int
    nbytes: int
    reps: int
    kvactors_gbps: float
    raw_gbps: float
    lmcache_gbps: float | None
    vs_raw: float
    vs_lmcache: float | None
    reused_gbps: float | None = None
    """kvactors with the plan of a repeated request reused (the runtime's plan cache: no
    planning, index tensors kept), i.e. the kernel alone."""


class _Setup:
    """Operands of one layout; built once, reused for both directions."""

    def __init__(self, layout: str, w: BenchWorkload, seed: int) -> None:
        self.fmt = _FORMATS[layout]
        spec = FORMAT_SPECS[self.fmt]
        dtype = getattr(torch, w.dtype)
        nl, nb, bs = w.num_layers, w.num_blocks, w.block_size
        nh, hs = (1, w.mla_hs) if spec.is_mla else (w.num_heads, w.head_size)
        unit = spec.tensor_shape(nl, nb, bs, nh, hs)
        self.paged: Any
        if layout == "nhd_separate":
            self.paged = [torch.ones(unit, dtype=dtype) for _ in range(nl)]
        elif spec.is_kv_list:
            buf = torch.ones((2, nl, *unit), dtype=dtype)
            self.paged = [list(buf[0].unbind(0)), list(buf[1].unbind(0))]
        else:
            self.paged = list(torch.ones((nl, *unit), dtype=dtype).unbind(0))
        tokens = w.chunk_tokens
        oshape = spec.object_shape(nl, tokens, nh, hs)
        self.objects = [torch.zeros(oshape, dtype=dtype) for _ in range(w.chunks_per_call)]
        self.sources = [torch.ones(oshape, dtype=dtype) for _ in range(w.chunks_per_call)]
        bpo = tokens // bs
        self.block_ids = random.Random(seed).sample(range(nb), bpo * w.chunks_per_call)
        self.shape = ShapeDesc(
            kv_size=spec.planes,
            nl=nl,
            nb=nb,
            bs=bs,
            nh=nh,
            hs=hs,
            element_size=torch.empty(0, dtype=dtype).element_size(),
            dtype=w.dtype,
        )
        self.chunk_size = tokens
        self.nbytes = sum(o.nbytes for o in self.objects)
        self.scratch = ScratchCache()
        self.spec = spec
        self.nl, self.nh, self.hs, self.bs = nl, nh, hs, bs

    def kvactors(self, direction: int) -> Callable[[], None]:
        """A request the runtime never saw, as its CPU path runs one: a plan cache that holds
        nothing validates it in full and the kernel is specialised for the new plan."""
        req = TransferRequest(
            fmt=int(self.fmt),
            direction=direction,
            block_ids=tuple(self.block_ids),
            chunk_size=self.chunk_size,
            shape=self.shape,
        )
        paged, objects = self.paged, self.objects

        def run() -> None:
            cache = PlanCache("cpu", 0)
            found = cache.lookup(req, paged, objects)
            if found.memo is None:  # not wire-safe: the runtime runs the general kernels
                run_fast(found.plan, paged, objects, scratch=self.scratch)
                return
            reused_kernel(found.plan, paged, objects, found.memo, inference=found.inference)(
                paged, objects
            )

        return run

    def kvactors_reused(self, direction: int) -> Callable[[], None]:
        """A repeated request as the runtime runs it on CPU: the plan made once, and the
        kernel the runtime specialises for it once (``reused_kernel``: the operands known to
        be the planned ones)."""
        req = TransferRequest(
            fmt=int(self.fmt),
            direction=direction,
            block_ids=tuple(self.block_ids),
            chunk_size=self.chunk_size,
            shape=self.shape,
        )
        plan = plan_transfer(req, self.paged, self.objects, device_type="cpu")
        kernel = reused_kernel(plan, self.paged, self.objects, KernelMemo())
        paged, objects = self.paged, self.objects

        def run() -> None:
            kernel(paged, objects)

        return run

    def raw(self) -> Callable[[], None]:
        def run() -> None:
            for dst, src in zip(self.objects, self.sources, strict=True):
                dst.copy_(src)

        return run

    def lmcache(self, direction: int) -> Callable[[], None] | None:
        make = _baseline("lmcache_torch")
        if make is None:
            return None
        req = TransferRequest(
            fmt=int(self.fmt),
            direction=direction,
            block_ids=tuple(self.block_ids),
            chunk_size=self.chunk_size,
            shape=self.shape,
        )
        try:
            return make(req, self.paged, self.objects)
        except ImportError:  # the adapter is installed but lmcache itself is not
            return None


def _baseline(name: str) -> Callable[..., Callable[[], None]] | None:
    # Baselines come from plugins (the LMCache adapter registers LMCache's torch path), so
    # kvactors itself never imports lmcache. A baseline that fails to load is just absent.
    for ep in entry_points(group="kvactors.baselines"):
        if ep.name == name:
            try:
                fn = ep.load()
            except Exception:
                return None
            return fn  # type: ignore[no-any-return]
    return None


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_transfer_bench(
    layouts: Sequence[str] = LAYOUTS,
    directions: Sequence[str] = ("gather", "scatter"),
    threads: int | Sequence[int] = 1,
    *,
    quick: bool = False,
    reps: int | None = None,
    include_lmcache: bool = True,
    workload: BenchWorkload | None = None,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
) -> list[BenchRow]:
    """Measure gather (D2H) and scatter (H2D) per layout; return plain rows.

    Args:
        layouts: Names from :data:`LAYOUTS`.
        directions: ``"gather"`` and/or ``"scatter"``.
        threads: torch intra-op thread count(s); each gets its own rows.
        quick: Small pool (256 blocks) and few repetitions (a smoke run).
        reps: Timed repetitions per contender (default 15, quick 4).
        include_lmcache: Also time LMCache's torch path when lmcache is importable.
        workload: The shape (default :class:`BenchWorkload`).
        progress: Called with a line of text per finished row.
        seed: Block id sampling seed.

    Returns:
        One :class:`BenchRow` per thread count x layout x direction.
    """
    w = workload or BenchWorkload()
    if quick and workload is None:
        w = msgspec.structs.replace(w, num_blocks=256)
    n_reps = reps if reps is not None else (4 if quick else 15)
    thread_list = [threads] if isinstance(threads, int) else list(threads)
    bad = [x for x in layouts if x not in _FORMATS]
    if bad or any(d not in ("gather", "scatter") for d in directions):
        raise InvalidSettingError(
            f"unknown layouts {bad} or directions {list(directions)}", setting="layouts"
        )
    old_threads = torch.get_num_threads()
    rows: list[BenchRow] = []
    try:
        for layout in layouts:
            setup = _Setup(layout, w, seed)
            for nt in thread_list:
                torch.set_num_threads(nt)
                for d in directions:
                    rows.append(_measure(setup, layout, d, nt, n_reps, include_lmcache))
                    if progress is not None:
                        progress(format_table(rows[-1:], header=False))
            del setup
    finally:
        torch.set_num_threads(old_threads)
    return rows


def _measure(
    setup: _Setup,
    layout: str,
    d: str,
    nt: int,
    n_reps: int,
    include_lmcache: bool,
) -> BenchRow:
    direction = 1 if d == "gather" else 0
    contenders: dict[str, Callable[[], None]] = {
        "kvactors": setup.kvactors(direction),
        "reused": setup.kvactors_reused(direction),
        "raw": setup.raw(),
    }
    lm = setup.lmcache(direction) if include_lmcache else None
    if lm is not None:
        contenders["lmcache"] = lm
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()  # warm-up (and staging allocation)
    for _ in range(n_reps):
        for name, fn in contenders.items():
            times[name].append(_time(fn))
    gbps = {k: setup.nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    lm_gbps = gbps.get("lmcache")
    return BenchRow(
        layout=layout,
        direction=d,
        threads=nt,
        nbytes=setup.nbytes,
        reps=n_reps,
        kvactors_gbps=gbps["kvactors"],
        raw_gbps=gbps["raw"],
        lmcache_gbps=lm_gbps,
        vs_raw=gbps["kvactors"] / gbps["raw"],
        vs_lmcache=None if lm_gbps is None else gbps["kvactors"] / lm_gbps,
        reused_gbps=gbps["reused"],
    )


def format_table(rows: Sequence[BenchRow], *, header: bool = True) -> str:
    """Rows as a fixed-width text table."""

    def opt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    lines = []
    if header:
        lines.append(
            f"{'layout':<13}{'dir':<8}{'thr':>3} {'MiB':>6} {'kvactors':>9} {'raw':>7} "
            f"{'lmcache':>8} {'reused':>7} {'vs raw':>7} {'vs lmc':>7}"
        )
    for r in rows:
        lines.append(
            f"{r.layout:<13}{r.direction:<8}{r.threads:>3} {r.nbytes / 2**20:>6.0f} "
            f"{r.kvactors_gbps:>9.2f} {r.raw_gbps:>7.2f} {opt(r.lmcache_gbps, '>8.2f')} "
            f"{opt(r.reused_gbps, '>7.2f')} {r.vs_raw:>7.2f} {opt(r.vs_lmcache, '>7.1f')}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; prints a table of GB/s and ratios."""
    ap = argparse.ArgumentParser(prog="python -m kvactors.cli.bench.transfer", description=__doc__)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--directions", nargs="+", default=["gather", "scatter"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None, help="paged pool size in blocks")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-lmcache", action="store_true")
    args = ap.parse_args(argv)
    w = BenchWorkload() if args.blocks is None else BenchWorkload(num_blocks=args.blocks)
    print(format_table([]))
    run_transfer_bench(
        args.layouts,
        args.directions,
        args.threads,
        quick=args.quick,
        reps=args.reps,
        include_lmcache=not args.no_lmcache,
        workload=w if args.blocks is not None or not args.quick else None,
        progress=print,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
