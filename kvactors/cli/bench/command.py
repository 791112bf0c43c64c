"""``kvactors bench``: GB/s through the runtime, per-call host cost on CPU, and kvactors' op
against LMCache's own MLU/MUSA ops on the fake vendors; one JSON file and one PNG.

Every figure is a ratio of contenders measured in the same run (:mod:`._harness`).
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    import argparse

__all__ = ("BenchReport", "add_arguments", "run")


class BenchReport(msgspec.Struct, kw_only=True):
    """Everything one ``kvactors bench`` run measured (``bench.json``)."""

    meta: dict[str, Any]
    transfer: list[TransferRow] = []
    percall: list[PercallRow] = []
    vendor: list[VendorRow] = []
    seconds: float = 0.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of ``kvactors bench``."""
    from kvactors.cli._devenv import DEVICE_KINDS

    add = ap.add_argument
    add("--device", choices=DEVICE_KINDS, default="cpu", help="device of the GB/s figures")
    add("--quick", action="store_true", help="small pools, fewer calls (minutes on 2 cores)")
    add("--out", default="bench-out", metavar="DIR", help="where bench.json and bench.png go")
    add("--layouts", nargs="+", type=str.lower, choices=tuple(FORMATS), metavar="LAYOUT")
    add("--reps", type=int, help="timed calls per contender of the GB/s figures")
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
    from kvactors.cli.bench._harness import progress
    from kvactors.errors import BackendUnavailableError

    layouts = tuple(args.layouts or FORMATS)
    cases = [c for c in CASES if c[1] in layouts] if not args.no_percall else []
    calls = args.calls or (100 if args.quick else 300)
    steps = 2 * (len(layouts) * (not args.percall) + len(cases)) + (not args.no_vendor)
    step, t0 = progress(steps), time.perf_counter()
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": str(torch.__version__)}
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report = BenchReport(meta={**meta, "device": args.device, "quick": args.quick, "when": when})
    rounds = 5 if args.quick else 9
    try:
        if not args.percall:
            with device_env(args.device) as env:
                report.meta["device_note"] = env.note
                reps, blocks = args.reps or (9 if args.quick else 15), 256 if args.quick else 1024
                report.transfer = transfer.run_transfer(
                    env, layouts, reps=reps, blocks=blocks, progress=step
                )
        report.percall = percall.run_percall(cases=cases, calls=calls, rounds=rounds, progress=step)
        if not args.no_vendor:
            vcalls, py = max(calls // 5, 4), args.vendor_python
            report.vendor, left_out = vendor.run_vendor(calls=vcalls, rounds=rounds, python=py)
            report.meta["vendors_left_out"] = left_out
            step("fake vendors")
    except BackendUnavailableError as exc:
        print(f"kvactors bench: {exc}", file=sys.stderr)
        return 2
    report.seconds = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(report), indent=2))
    if report.transfer:
        print(transfer.format_transfer(report.transfer), end="\n\n")
    if report.percall:
        print(percall.format_percall(report.percall), end="\n\n")
    if report.vendor:
        print(vendor.format_vendor(report.vendor), end="\n\n")
    if not args.no_plot:
        from kvactors.cli.bench._plot import plot

        png = os.path.join(args.out, "bench.png")
        plot(report.transfer, report.percall, report.vendor, report.meta, png)
        path += " and bench.png"
    for line in report.meta.get("vendors_left_out", []):
        print(f"fake vendor {line}")
    print(f"wrote {path} in {report.seconds:.1f}s")
    return 0
