"""``kvactors replay TRACE``: replay a recorded trace (:mod:`kvactors.observe.trace`) afresh."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import msgspec

from kvactors.cli._devenv import device_env
from kvactors.observe.trace import replay
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    import argparse

__all__ = ("run",)


def run(args: argparse.Namespace) -> int:
    """``kvactors replay TRACE``: 0 when every call had its recorded outcome."""
    try:
        with device_env(args.device) as env, Runtime(env.kind) as rt:
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
