"""``kvactors validate STORED RESTORED``: KV bit equality between two dumps.

The dump format and the comparison are :mod:`kvactors.observe.kvdump`; exit 0 when identical,
1 on a mismatch (of bits or of layout: layer or block count, block axis, dtype, shape), 2 on a
file that is not a well-formed dump, including one that describes more memory than it holds
(stride-0, overlapping or out-of-bounds layers, compressed members), refused before the
comparison allocates anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import msgspec

from kvactors.observe.kvdump import compare_kv, format_report, load_dump

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("add_arguments", "main", "run")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command line of ``kvactors validate`` (shared with ``python -m``)."""
    ap.add_argument("stored", help="dump of the KV as stored (kvactors.observe.kvdump.save_dump)")
    ap.add_argument("restored", help="dump of the KV as restored")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--max-report", type=int, default=50, help="mismatches listed (default 50)")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``validate`` command; 0 when identical, 1 on a mismatch, 2 on bad input."""
    try:
        report = compare_kv(
            load_dump(args.stored), load_dump(args.restored), max_report=args.max_report
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"kvactors validate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvactors.cli.validate STORED RESTORED``."""
    ap = argparse.ArgumentParser(prog="python -m kvactors.cli.validate", description=__doc__)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
