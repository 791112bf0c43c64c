"""``kvactors demo`` on the command line: run, attach observers, print the summary."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from kvactors.cli.demo import DemoConfig, DemoReport, run_demo
from kvactors.errors import BackendUnavailableError
from kvactors.observe.logs import get_logger

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from kvactors.runtime import Runtime

__all__ = ("format_summary", "format_stats", "run")

_log = get_logger("kvactors.demo")


def format_stats(report: DemoReport) -> str:
    """Every actor's statistics snapshot as a table."""
    s = report.statistics
    if s is None:
        return "(no statistics)"
    lines = [
        f"device {s.device}: transfers ok={s.transfers_ok} failed={s.transfers_failed} "
        f"bytes={s.bytes_moved} inflight={s.inflight} ipc_owners_open={s.ipc_owners_open} "
        f"completions_pending={s.completions_pending} events_pending={s.events_pending}",
        f"  {'actor':<22}{'state':<10}{'depth':>6}{'peak':>6}{'cap':>6}"
        f"{'processed':>10}{'failed':>7}{'deferred':>9}",
    ]
    for a in s.actors:
        lines.append(
            f"  {a.name:<22}{a.state:<10}{a.mailbox_depth:>6}{a.mailbox_peak:>6}"
            f"{a.capacity:>6}{a.processed:>10}{a.failed:>7}{a.deferred_pending:>9}"
        )
    return "\n".join(lines)


def format_summary(r: DemoReport) -> str:
    """The human-readable result of a demo run."""
    moved = r.bytes_h2d + r.bytes_d2h
    secs = max(r.seconds, 1e-9)
    transfers = r.stores + r.retrieves
    verdict = (
        "PASS: every restored block and every stored chunk is bit-identical"
        if r.ok
        else "FAIL: see the mismatches and errors above"
    )
    lines = [
        f"kvactors demo on {r.note}",
        f"  requests served      {r.requests} ({r.preemptions} preemptions, requeued and resumed)",
        f"  lookups              {r.lookups}: {r.hit_chunks} chunks hit, {r.miss_chunks} missed",
        f"  stores (D2H)         {r.stores} transfers, {r.bytes_d2h / 2**20:.1f} MiB; "
        f"{r.chunks_stored} chunks verified before publishing, {r.chunk_mismatches} corrupt",
        f"  retrieves (H2D)      {r.retrieves} transfers, {r.bytes_h2d / 2**20:.1f} MiB; "
        f"{r.blocks_verified}/{r.blocks_restored} restored blocks bit-identical, "
        f"{r.block_mismatches} mismatched",
        f"  fences before reuse  {r.fences}",
        f"  throughput           {moved / max(r.busy_seconds, 1e-9) / 1e9:.2f} GB/s while "
        f"transfers were in flight ({r.busy_seconds:.2f}s busy); {transfers / secs:.0f} "
        f"transfers/s and {moved / secs / 1e9:.2f} GB/s over the whole run",
        f"  wall time            {r.seconds:.2f}s (includes generating and verifying the KV)",
    ]
    if r.transfer_errors:
        lines.append(f"  transfer errors      {len(r.transfer_errors)}:")
        lines += [f"    {e}" for e in r.transfer_errors[:10]]
    lines.append(verdict)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``demo`` command; exit status 0 only when everything verified."""
    cfg = DemoConfig(
        device=args.device,
        requests=args.requests,
        seed=args.seed,
        skip_fences=args.unsafe_skip_fences,
    )
    cleanups: list[Callable[[], Any]] = []

    def attach(rt: Runtime) -> None:
        if args.trace:
            from kvactors.observe.trace import TraceRecorder

            cleanups.append(TraceRecorder(args.trace, device=args.device).attach(rt).close)
        if args.prometheus_port is not None:
            from kvactors.observe.metrics import CallMetrics, register_prometheus

            calls = CallMetrics()
            cleanups.append(calls.attach(rt))
            cleanups.append(register_prometheus(rt, calls=calls, port=args.prometheus_port))

    _log.info(
        "demo starting", extra={"device": cfg.device, "requests": cfg.requests, "seed": cfg.seed}
    )
    try:
        report = run_demo(cfg, attach=attach)
    except (BackendUnavailableError, ImportError) as exc:
        print(f"kvactors demo: {exc}", file=sys.stderr)
        return 2
    finally:
        for c in reversed(cleanups):
            c()
    _log.info("demo finished", extra={"ok": report.ok, "seconds": round(report.seconds, 3)})
    if args.json:
        out = msgspec.to_builtins(report)
        out["ok"] = report.ok
        print(json.dumps(out, indent=2))
    else:
        if args.stats:
            print(format_stats(report))
        print(format_summary(report))
        if args.trace:
            print(f"trace written to {args.trace} (replay: kvactors replay {args.trace})")
    return 0 if report.ok else 1
