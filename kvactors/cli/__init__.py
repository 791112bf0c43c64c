"""The ``kvactors`` command: ``doctor``, ``demo``, ``bench``, ``validate``,
``validate-serving``, ``selftest``, ``replay``.

Each subcommand lives in its own module and is imported only when it runs, so
``kvactors doctor`` works even where a heavier dependency (matplotlib) is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ("build_parser", "main", "parse_args")

#: The module whose ``run(args)`` runs each command but ``doctor`` (imported when it runs).
_RUN = {
    "demo": "kvactors.cli._demo_cli",
    "bench": "kvactors.cli.bench.command",
    "validate": "kvactors.cli.validate",
    "validate-serving": "kvactors.cli.serving",
    "selftest": "kvactors.cli.selftest",
    "replay": "kvactors.cli.replay",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvactors``."""
    from kvactors.cli._devenv import DEVICE_KINDS

    # The logging flags are accepted before and after the subcommand; SUPPRESS keeps a
    # subcommand's parser from resetting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        help="logging level of the kvactors loggers (default WARNING)",
    )
    common.add_argument(
        "--log-json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log as JSON lines to stderr",
    )
    ap = argparse.ArgumentParser(
        prog="kvactors",
        description="KV-cache transfer runtime for LMCache on MLU, MUSA and CPU.",
        parents=[common],
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help)

    doc = add_parser("doctor", help="backends, LMCache plugin selection, environment")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument(
        "--fake",
        choices=("mlu", "musa"),
        default=None,
        help="answer as on a host with one such device (kvactors' fake vendor)",
    )

    demo = add_parser("demo", help="simulated serving workload, verified bit for bit")
    demo.add_argument("--device", choices=DEVICE_KINDS, default="cpu")
    demo.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--stats", action="store_true", help="print every actor's statistics")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.add_argument("--trace", metavar="FILE", help="record a replayable message trace")
    demo.add_argument(
        "--prometheus-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on PORT while the demo runs",
    )
    demo.add_argument(
        "--unsafe-skip-fences",
        action="store_true",
        help="negative control: reuse blocks without a fence (should FAIL)",
    )

    bench = add_parser(
        "bench", help="GB/s, per-call cost, kvactors vs LMCache's own ops; JSON and PNG"
    )
    from kvactors.cli.bench.command import add_arguments as bench_args

    bench_args(bench)

    val = add_parser("validate", help="compare stored and restored KV dumps bit for bit")
    from kvactors.cli.validate import add_arguments as validate_args

    validate_args(val)

    # Its other flags (and --help) are the procedure's: passed through, see main().
    vs = sub.add_parser(
        "validate-serving",
        parents=[common],
        add_help=False,
        help="vLLM + LMCache + kvactors serving validation (runs in the engine's venv)",
    )
    from kvactors.cli.serving import add_arguments as serving_args

    serving_args(vs)

    st = add_parser("selftest", help="conformance suite on one device (real, or --fake)")
    from kvactors.cli.selftest import add_arguments as selftest_args

    selftest_args(st)

    rep = add_parser("replay", help="replay a recorded trace on a fresh runtime")
    from kvactors.cli.replay import add_arguments as replay_args

    replay_args(rep)
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``kvactors``' arguments; ``validate-serving`` keeps the procedure's in
    ``procedure_args`` (every other command refuses unknown arguments)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "validate-serving":
        args.procedure_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvactors``; returns the process exit status."""
    args = parse_args(argv)
    from kvactors.observe.logs import configure

    # Actions are shared between parsers (parents=), so defaults live here, not in set_defaults.
    configure(
        level=getattr(args, "log_level", "WARNING"), json_format=getattr(args, "log_json", False)
    )
    if args.command == "doctor":
        return _doctor(args)
    import importlib

    run: Callable[[argparse.Namespace], int] = importlib.import_module(_RUN[args.command]).run
    return run(args)


def _doctor(args: argparse.Namespace) -> int:
    from kvactors.cli.doctor import collect, format_doctor

    report = collect(fake=args.fake)
    if args.json:
        data = msgspec.to_builtins(report)
        data["ok"] = report.ok
        print(json.dumps(data, indent=2))
    else:
        print(format_doctor(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
