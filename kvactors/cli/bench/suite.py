"""``kvactors bench``: transfer and per-call benchmarks, written as JSON and PNG plots.

Every figure is a ratio measured inside one run: **kernels** (:mod:`kvactors.cli.bench.transfer`,
host-side), **runtime** (an NHD transfer through :class:`~kvactors.runtime.Runtime` on
``--device`` against a raw copy of the same bytes), **vendor**
(:mod:`kvactors.cli.bench.vendor`, the fake MLU and MUSA against LMCache's own ops) and
**per call** (:mod:`kvactors.cli.bench.percall`, also written to ``percall.png``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.cli.bench._report import BenchReport, RuntimeRow
from kvactors.cli.bench.transfer import LAYOUTS, BenchWorkload, run_transfer_bench

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from kvactors.cli._devenv import DeviceEnv
    from kvactors.cli.bench.transfer import BenchRow

__all__ = ("BenchConfig", "BenchReport", "RuntimeRow", "add_arguments", "run", "run_bench")


class BenchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kvactors bench`` measures."""

    device: str = "cpu"
    quick: bool = False
    layouts: tuple[str, ...] = LAYOUTS
    directions: tuple[str, ...] = ("gather", "scatter")
    threads: tuple[int, ...] = (1, 2)
    reps: int | None = None
    include_lmcache: bool = True
    runtime: bool = True
    vendor: bool = True
    percall: bool = True
    seed: int = 0


class _Progress:
    """A stdlib progress bar on stderr (redrawn in place on a terminal, else one line a step)."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = max(total, 1), 0, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.1f}s {label}"
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line + ("\n" if self.done >= self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _runtime_rows(env: DeviceEnv, w: BenchWorkload, reps: int, seed: int) -> list[RuntimeRow]:
    import random

    from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

    dtype = getattr(torch, w.dtype)
    nl, nb, bs, nh, hs = w.num_layers, w.num_blocks, w.block_size, w.num_heads, w.head_size
    backing = env.zeros((nl, 2, nb, bs, nh, hs), dtype)
    paged = list(backing.unbind(0))
    oshape = (2, nl, w.chunk_tokens, nh * hs)
    objects = [torch.zeros(oshape, dtype=dtype) for _ in range(w.chunks_per_call)]
    raw_host = torch.zeros((w.chunks_per_call, *oshape), dtype=dtype)
    # Every buffer written once (an untouched allocation reads as the shared zero page).
    for t in (backing, raw_host, *objects):
        t.fill_(1)
    # The raw copy moves the same bytes between the same kinds of memory: a region of the pool
    # itself (a separate buffer may get huge pages the pool does not).
    raw_dev = backing.view(-1)[: raw_host.numel()].view(raw_host.shape)
    ids = tuple(random.Random(seed).sample(range(nb), w.chunk_tokens // bs * w.chunks_per_call))
    shape = ShapeDesc(
        kv_size=2,
        nl=nl,
        nb=nb,
        bs=bs,
        nh=nh,
        hs=hs,
        element_size=torch.empty(0, dtype=dtype).element_size(),
        dtype=w.dtype,
    )
    nbytes = sum(o.nbytes for o in objects)
    rows: list[RuntimeRow] = []
    with Runtime(env.backend(), default_timeout=120.0) as rt:
        for d, direction in (("gather", Direction.D2H), ("scatter", Direction.H2D)):
            req = TransferRequest(
                fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
                direction=int(direction),
                block_ids=ids,
                chunk_size=w.chunk_tokens,
                shape=shape,
            )

            def through() -> None:
                rt.transfer(req, paged, objects)  # noqa: B023 - used in this iteration only

            def raw() -> None:
                if d == "gather":  # noqa: B023
                    raw_host.copy_(raw_dev)
                else:
                    raw_dev.copy_(raw_host)
                env.synchronize()

            times: dict[str, list[float]] = {"runtime": [], "raw": []}
            through()
            raw()
            for _ in range(reps):
                for name, fn in (("runtime", through), ("raw", raw)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            g = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            rows.append(
                RuntimeRow(
                    device=env.kind,
                    simulated=env.simulated,
                    direction=d,
                    nbytes=nbytes,
                    reps=reps,
                    runtime_gbps=g["runtime"],
                    raw_gbps=g["raw"],
                    vs_raw=g["runtime"] / g["raw"],
                )
            )
    return rows


def run_bench(cfg: BenchConfig, *, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Run every part of the benchmark; see the module docstring.

    Args:
        cfg: What to measure.
        progress: Called with a label after each finished step.
    """
    from kvactors.cli._devenv import device_env

    t0 = time.perf_counter()
    step = progress or (lambda _label: None)
    threads = cfg.threads if not cfg.quick or cfg.threads != (1, 2) else (1,)
    meta: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "device": cfg.device,
        "quick": cfg.quick,
        "threads": list(threads),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    reps = cfg.reps if cfg.reps is not None else (9 if cfg.quick else 15)
    rows: list[BenchRow] = []
    if cfg.layouts:
        rows = run_transfer_bench(
            list(cfg.layouts),
            list(cfg.directions),
            list(threads),
            quick=cfg.quick,
            reps=reps,
            include_lmcache=cfg.include_lmcache,
            seed=cfg.seed,
            progress=lambda line: step(" ".join(line.split()[:3])),
        )
    meta["lmcache_baseline"] = any(r.lmcache_gbps is not None for r in rows)
    runtime: list[RuntimeRow] = []
    if cfg.runtime:
        w = BenchWorkload(num_blocks=256) if cfg.quick else BenchWorkload()
        threads_before = torch.get_num_threads()
        torch.set_num_threads(1)  # like every other figure (the transfer rows set their own)
        try:
            with device_env(cfg.device, seed=cfg.seed) as env:
                meta["device_note"] = env.note
                runtime = _runtime_rows(env, w, reps, cfg.seed)
        finally:
            torch.set_num_threads(threads_before)
        step(f"runtime {cfg.device}")
    vendor = None
    if cfg.vendor:
        import dataclasses

        from kvactors.cli.bench.vendor import run_vendor_bench

        vreps = cfg.reps if cfg.reps is not None else (5 if cfg.quick else 30)
        vendor = [dataclasses.asdict(r) for r in run_vendor_bench(reps=vreps)]
        step("vendor")
    percall = None
    if cfg.percall:
        from kvactors.cli.bench.percall import run_percall_bench

        kinds = ("nhd", "hnd", "mla", "kv_list")
        percall = run_percall_bench(
            quick=cfg.quick,
            seed=cfg.seed,
            reps=cfg.reps,
            layouts=[x for x in cfg.layouts if x in kinds] or ["nhd"],
        )
        step("per call")
    return BenchReport(
        meta=meta,
        transfer=rows,
        runtime=runtime,
        vendor=vendor,
        percall=percall,
        seconds=time.perf_counter() - t0,
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of ``kvactors bench``."""
    from kvactors.cli._devenv import DEVICE_KINDS

    ap.add_argument(
        "--device",
        choices=DEVICE_KINDS,
        default="cpu",
        help="device of the runtime figures (kernel figures are host-side)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small pool, few repetitions, 1 thread (under 2 minutes on 2 cores)",
    )
    ap.add_argument(
        "--out",
        default="bench-out",
        metavar="DIR",
        help="where bench.json and bench.png go (default bench-out)",
    )
    ap.add_argument(
        "--layouts",
        nargs="+",
        type=str.lower,
        choices=LAYOUTS,
        default=None,
        metavar="LAYOUT",
        help=f"subset of {', '.join(LAYOUTS)}",
    )
    ap.add_argument(
        "--directions", nargs="+", choices=("gather", "scatter"), default=["gather", "scatter"]
    )
    ap.add_argument(
        "--threads",
        nargs="+",
        type=int,
        default=None,
        help="torch intra-op thread counts (default 1 2; --quick: 1)",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per contender")
    ap.add_argument("--no-lmcache", action="store_true", help="skip LMCache's torch path")
    ap.add_argument("--no-runtime", action="store_true", help="skip the through-runtime figures")
    ap.add_argument(
        "--no-vendor",
        action="store_true",
        help="skip kvactors vs LMCache's own MLU/MUSA ops on the fake vendors",
    )
    ap.add_argument("--no-percall", action="store_true", help="skip the per-call figures")
    ap.add_argument("--no-plot", action="store_true", help="write the JSON only")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``bench`` command; writes ``bench.json`` and ``bench.png`` under ``--out``."""
    from kvactors.cli.bench.transfer import format_table
    from kvactors.errors import BackendUnavailableError

    threads = tuple(args.threads) if args.threads else ((1,) if args.quick else (1, 2))
    cfg = BenchConfig(
        device=args.device,
        quick=args.quick,
        layouts=tuple(args.layouts) if args.layouts else LAYOUTS,
        directions=tuple(args.directions),
        threads=threads,
        reps=args.reps,
        include_lmcache=not args.no_lmcache,
        runtime=not args.no_runtime,
        vendor=not args.no_vendor,
        percall=not args.no_percall,
    )
    n_steps = (
        len(cfg.layouts) * len(cfg.directions) * len(threads)
        + int(cfg.runtime)
        + int(cfg.vendor)
        + int(cfg.percall)
    )
    bar = _Progress(n_steps)
    try:
        report = run_bench(cfg, progress=bar.step)
    except BackendUnavailableError as exc:
        print(f"kvactors bench: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    with open(json_path, "w") as f:
        json.dump(msgspec.to_builtins(report), f, indent=2)
    print(format_table(report.transfer))
    for r in report.runtime:
        sim = " (SIMULATED device: not a throughput figure)" if r.simulated else ""
        print(
            f"runtime {r.device} {r.direction:<8} {r.runtime_gbps:6.2f} GB/s vs raw copy "
            f"{r.raw_gbps:6.2f} GB/s = {r.vs_raw:.2f}{sim}"
        )
    if report.vendor is not None:
        from kvactors.cli.bench.vendor import VendorRow, format_vendor_table

        print(
            format_vendor_table(
                [VendorRow(**{**d, "violations": tuple(d["violations"])}) for d in report.vendor]
            )
        )
    if report.percall is not None:
        from kvactors.cli.bench.percall import format_percall

        print(format_percall(report.percall))
    print(f"wrote {json_path}", end="")
    if not args.no_plot:
        from kvactors.cli.bench._plot import plot

        png = os.path.join(args.out, "bench.png")
        plot(report, png)
        print(f" and {png}", end="")
        if report.percall is not None:
            from kvactors.cli.bench.percall import plot_percall

            png = os.path.join(args.out, "percall.png")
            plot_percall(report.percall, png)
            print(f" and {png}", end="")
    print(f" in {report.seconds:.1f}s")
    return 0
