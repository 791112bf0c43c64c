"""``kvactors replay TRACE``: replay a recorded trace (:mod:`kvactors.observe.trace`) afresh.

The runtime's backend takes the settings the trace recorded (``replay_backend``; on MLU the
layout source), so a trace of ``kvactors demo --device mlu`` replays as it ran.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import msgspec

from kvactors.cli._devenv import device_env
from kvactors.observe.trace import read_trace, replay, replay_backend
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    import argparse

__all__ = ("run",)


def run(args: argparse.Namespace) -> int:
    """``kvactors replay TRACE``: 0 when every call had its recorded outcome."""
    try:
        header, _ = read_trace(args.trace)
        with device_env(args.device) as env:
            backend = replay_backend(header, env.kind, default=env.backend())
            with Runtime(backend) as rt:
                report = replay(args.trace, rt, env=env)
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
