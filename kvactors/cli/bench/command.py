"""``kvactors bench``: one-chunk calls through the runtime against the link and bare torch
on any device, per-call host cost on CPU, and kvactors' op
against LMCache's own MLU/MUSA ops on the fake vendors; one JSON file and one PNG.

Every figure is a ratio of contenders measured in the same run (:mod:`._harness`).
"""

from __future__ import annotations

import itertools
import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvactors.cli.bench._pools import FORMATS
from kvactors.cli.bench.percall import CASES, PercallRow
from kvactors.cli.bench.transfer import TransferRow
from kvactors.cli.bench.vendor import VendorRow
from kvactors.errors import MissingDependencyError

if TYPE_CHECKING:
    import argparse

__all__ = ("BenchReport", "add_arguments", "plot", "run")


class BenchReport(msgspec.Struct, kw_only=True):
    """Everything one ``kvactors bench`` run measured (``bench.json``)."""

    meta: dict[str, Any]
    transfer: list[TransferRow] = []
    percall: list[PercallRow] = []
    vendor: list[VendorRow] = []


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of ``kvactors bench``."""
    from kvactors.cli._devenv import DEVICE_KINDS

    add = ap.add_argument
    add("--device", choices=DEVICE_KINDS, default="cpu", help="device of the GB/s figures")
    add("--quick", action="store_true", help="small pools, fewer calls (minutes on 2 cores)")
    add("--out", default="bench-out", metavar="DIR", help="where bench.json and bench.png go")
    add("--layouts", nargs="+", type=str.lower, choices=tuple(FORMATS), metavar="LAYOUT")
    add("--reps", type=int, help="calls per thread and window of the one-chunk calls")
    add("--calls", type=int, help="calls per thread and window of the per-call figures")
    add("--percall", action="store_true", help="only the per-call figures (CPU, fake vendors)")
    add("--no-percall", action="store_true", help="skip the per-call figures on CPU")
    add("--no-vendor", action="store_true", help="skip kvactors vs LMCache's MLU/MUSA ops")
    add("--vendor-python", metavar="PY", help="interpreter of the vendor runs (its LMCache)")
    add("--no-plot", action="store_true", help="write the JSON only")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``bench`` command; writes ``bench.json`` and ``bench.png`` in ``--out``."""
    import torch

    from kvactors.cli._devenv import device_env
    from kvactors.cli.bench import percall, transfer, vendor
    from kvactors.errors import BackendUnavailableError

    layouts = tuple(args.layouts or FORMATS)
    cases = [c for c in CASES if c[1] in layouts] if not args.no_percall else []
    calls = args.calls or (100 if args.quick else 300)
    steps = 2 * (len(layouts) * (not args.percall) + len(cases)) + (not args.no_vendor)
    done, t0 = itertools.count(1), time.perf_counter()

    def step(label: str) -> None:
        print(f"[{next(done)}/{steps}] {time.perf_counter() - t0:6.1f}s {label}", file=sys.stderr)

    meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": str(torch.__version__)}
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report = BenchReport(meta={**meta, "device": args.device, "quick": args.quick, "when": when})
    rounds = 5 if args.quick else 9
    report.meta |= {"calls": calls, "rounds": rounds}
    try:
        if not args.percall:
            with device_env(args.device) as env:
                report.meta["device_note"] = env.note
                # The h200 review's operands; smaller on CPU (memory) and in quick runs.
                model, blocks = ("small", 256) if args.quick else ("8b", 4096)
                if args.device == "cpu" and not args.quick:
                    blocks = 1024
                # Windows of 30 calls in quick runs too: four threads start and finish a
                # window together, which a window of a few calls would mostly measure.
                reps = args.reps or 30
                report.meta |= {"transfer_model": model, "transfer_blocks": blocks}
                report.transfer = transfer.run_transfer(
                    env, layouts, reps=reps, rounds=3 if args.quick else 5, blocks=blocks,
                    model=model, progress=step,
                )  # fmt: skip
        report.percall = percall.run_percall(cases=cases, calls=calls, rounds=rounds, progress=step)
        if not args.no_vendor:
            vcalls, py = max(calls // 5, 4), args.vendor_python
            report.vendor, left_out = vendor.run_vendor(calls=vcalls, rounds=rounds, python=py)
            report.meta["vendors_left_out"] = left_out
            step("fake vendors")
    except BackendUnavailableError as exc:
        print(f"kvactors bench: {exc}", file=sys.stderr)
        return 2
    report.meta["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(report), indent=2))
    tables = (transfer.format_transfer(report.transfer), percall.format_percall(report.percall))
    for text in (*tables, vendor.format_vendor(report.vendor)):
        print(text, end="\n\n" if text else "")
    if not args.no_plot:
        plot(report, os.path.join(args.out, "bench.png"))
        path += " and bench.png"
    for line in report.meta.get("vendors_left_out", []):
        print(f"fake vendor {line}")
    print(f"wrote {path} in {report.meta['seconds']:.1f}s")
    return 0


def plot(report: BenchReport, path: str) -> None:
    """The run's figure (GB/s, per-call ratios, kvactors over LMCache on the fakes) as a PNG;
    matplotlib (``pip install kvactors[bench]``, Agg) or MissingDependencyError."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "the bench plot needs matplotlib: pip install 'kvactors[bench]'", package="matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, pc, m = report.transfer, report.percall, report.meta
    vendor: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in report.vendor:
        vendor.setdefault((r.vendor, r.layout, r.direction), {})[r.contender] = r.host_us
    keys = [k for k, c in vendor.items() if "kvactors" in c]
    panels = [
        (f"GB/s, one chunk a call ({t[0].device if t else ''})",
         [f"{r.layout}\n{r.direction}" for r in t], None,
         {n: [r.timings[f"{n}@1"].gbps if f"{n}@1" in r.timings else 0.0 for r in t]
          for n in ("kvactors", "bare", "raw", "lmcache")}),
        ("per call on CPU, ratio", [f"{r.model} {r.layout}\n{r.direction}" for r in pc], 1.0,
         {"kvactors / torch, 1 caller": [r.vs_torch["1"] for r in pc],
          "kvactors / torch, 4 callers": [r.vs_torch["4"] for r in pc],
          "kvactors calls/s, 4 callers / 1": [r.scaling["kvactors"] for r in pc]}),
        ("fake vendors, ratio", [f"{v} {lay}\n{d}" for v, lay, d in keys], 0.5,
         {f"kvactors / LMCache host us, {n} thread(s)":
          [vendor[k]["kvactors"][n] / vendor[k]["lmcache"][n] for k in keys] for n in "14"}),
    ]  # fmt: skip
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (ylabel, labels, line, series) in zip(axes[:, 0], panels, strict=True):
        width = 0.8 / len(series)
        for i, (name, vals) in enumerate(series.items()):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
            ax.bar(xs, vals, width, label=name)
        if line is not None:
            ax.axhline(line, color="grey", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=6.5)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"kvactors bench{' --quick' if m.get('quick') else ''}: {m.get('cpus')} CPUs, "
        f"torch {m.get('torch')}, {m.get('when')} (ratios from one run)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
