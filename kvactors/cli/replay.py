"""``kvactors replay TRACE``: replay a recorded trace (:mod:`kvactors.observe.trace`) afresh.

The runtime's backend takes the settings the trace recorded (``replay_backend``; on MLU the
layout source), so a trace of ``kvactors demo --device mlu`` replays as it ran. A trace whose
synthetic operands would exceed ``--max-bytes`` (all calls together, whatever their recorded
outcome; default :data:`~kvactors.observe.trace.DEFAULT_MAX_BYTES`) is refused before anything
is allocated (exit 2).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import msgspec

from kvactors.cli._devenv import DEVICE_KINDS, device_env
from kvactors.errors import InvalidSettingError
from kvactors.observe.trace import DEFAULT_MAX_BYTES, read_trace, replay, replay_backend
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    import argparse

__all__ = ("add_arguments", "run")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of ``kvactors replay``."""
    ap.add_argument("trace", help="a file written by `kvactors demo --trace`")
    ap.add_argument("--device", choices=DEVICE_KINDS, default="cpu")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--max-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_BYTES,
        metavar="N",
        help="refuse a trace whose synthetic operands, all calls together, exceed N bytes "
        f"(default {DEFAULT_MAX_BYTES // 2**20} MiB; 0 lifts the cap)",
    )


def _byte_count(text: str) -> int:
    # argparse reports a ValueError as "invalid _byte_count value: '<text>'".
    n = int(text)
    if n < 0:
        raise InvalidSettingError(f"--max-bytes must be >= 0, got {n}", setting="--max-bytes")
    return n


def run(args: argparse.Namespace) -> int:
    """``kvactors replay TRACE``: 0 when every call had its recorded outcome. ``args``
    without ``max_bytes`` (a caller of the command's earlier arguments) keeps the default
    cap."""
    try:
        max_bytes = getattr(args, "max_bytes", DEFAULT_MAX_BYTES) or None  # 0 lifts the cap
        header, _ = read_trace(args.trace, max_bytes=max_bytes)  # refused before any runtime
        with device_env(args.device) as env:
            backend = replay_backend(header, env.kind, default=env.backend())
            with Runtime(backend) as rt:
                report = replay(args.trace, rt, env=env, max_bytes=max_bytes)
    except (OSError, ValueError) as exc:
        print(f"kvactors replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = msgspec.to_builtins(report)
        out["ok"] = report.ok
        print(json.dumps(out, indent=2))
    else:
        print(
            f"replayed {report.calls} calls ({report.transfers} transfers, "
            f"{report.bytes_moved / 2**20:.1f} MiB) in {report.seconds:.2f}s "
            f"(recorded run: {report.recorded_seconds:.2f}s): "
            + (
                "every outcome as recorded"
                if report.ok
                else f"{len(report.outcome_mismatches)} outcomes differ"
            )
        )
        for m in report.outcome_mismatches[:20]:
            print(f"  {m}")
    return 0 if report.ok else 1
