"""``kvactors selftest``: the conformance suite on one device, in one command.

A thin shell around :func:`kvactors.testing.conformance.check.check_backend`: it parses the options,
runs the suite (on the real device, or with ``--fake`` on the simulated one), prints a
readable report, writes the JSON report with ``--json FILE``, and exits 0 only when every
check passed. Without the vendor runtime (and without ``--fake``) it exits 1 and names what
is missing.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from kvactors.testing.conformance.check import BackendReport

__all__ = ("add_arguments", "format_report", "run")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the ``selftest`` options to ``ap``."""
    from kvactors.cli._devenv import DEVICE_KINDS
    from kvactors.testing.conformance.check import CHECK_GROUPS

    ap.add_argument(
        "--device", choices=DEVICE_KINDS, default="cpu", help="the device to test (default cpu)"
    )
    ap.add_argument("--device-index", type=int, default=0, metavar="N")
    ap.add_argument(
        "--fake",
        action="store_true",
        help="run on kvactors.testing's fake vendor module (mlu, musa): SIMULATED",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    ap.add_argument(
        "--only",
        action="append",
        choices=CHECK_GROUPS,
        metavar="GROUP",
        help=f"run only these check groups (repeatable): {', '.join(CHECK_GROUPS)}",
    )


def run(args: argparse.Namespace) -> int:
    """Run the suite per ``args``; print the report; 0 only when every check passed."""
    from kvactors.testing.conformance.check import check_backend

    if args.fake and args.device not in ("mlu", "musa"):
        print(f"kvactors selftest: --fake simulates mlu and musa only, not {args.device}")
        return 2
    report = check_backend(
        args.device, fake=bool(args.fake), device_index=args.device_index, only=args.only
    )
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_builtins(), f, indent=2)
            f.write("\n")
    return 0 if report.ok else 1


def format_report(report: BackendReport) -> str:
    """The readable report: one line per check, then the verdict."""
    if report.simulated:
        where = "SIMULATED (fake vendor module from kvactors.testing, CPU memory; not hardware)"
    elif report.checks[0].ok:
        where = "real device"
    else:
        where = "not available here"
    lines = [f"kvactors selftest: {report.device}: {where}"]
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        status = "SKIP" if c.skipped else ("PASS" if c.ok else "FAIL")
        lines.append(f"  {status}  {c.name:<{width}}  {c.seconds * 1e3:8.1f} ms  {c.detail}")
    skipped = sum(c.skipped for c in report.checks)
    failed = len(report.failed)
    passed = len(report.checks) - skipped - failed
    verdict = "PASS" if report.ok else "FAIL"
    tag = " (SIMULATED)" if report.simulated else ""
    lines.append(f"{verdict}{tag}: {passed} passed, {skipped} skipped, {failed} failed")
    probe = report.checks[0]
    if probe.name == "probe" and not probe.ok and report.device.split(":")[0] in ("mlu", "musa"):
        lines.append(
            "hint: `kvactors selftest --device "
            f"{report.device.split(':')[0]} --fake` runs the suite on the simulated "
            "device"
        )
    return "\n".join(lines)
