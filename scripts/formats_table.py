"""The format compatibility table of ``docs/formats.md``, generated from LMCache's registry.

Every ``EngineKVFormat`` in the installed LMCache's format registry
(``lmcache.v1.gpu_connector.kv_format.specs.registry.SPECS``) becomes one row: its number and
name, the engines that produce it (the spec's ``attention_backends``), and whether kvactors
moves it on CPU, MLU and MUSA, read from the code that decides it (the adapter's format
mapping and the MLU and MUSA backends' format sets), with the reason when it refuses. The doc
holds one section per LMCache version; a test regenerates the installed version's section and
fails when the committed one differs, so a format a new LMCache adds shows up as a failing test.

    .venv/bin/python scripts/formats_table.py            # print this LMCache's section
    .venv/bin/python scripts/formats_table.py --write    # update it in docs/formats.md

(run it in the venv of each LMCache version, from a source checkout.)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("DOC", "main", "section", "update")

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
"""The committed doc."""

_BEGIN = "<!-- formats-table lmcache={version} begin -->"
_END = "<!-- formats-table lmcache={version} end -->"


def _cell(ok: bool) -> str:
    return "served" if ok else "refused"


def section(version: str) -> str:
    """The Markdown section for LMCache ``version`` (the installed one's registry)."""
    from lmcache.v1.gpu_connector.kv_format.specs.registry import SPECS

    from kvactors.devices.mlu.layouts import MLU_FORMATS
    from kvactors.devices.musa.contract import MUSA_MP_FORMATS
    from kvactors_lmcache.convert import refusal_reason, served_as

    lines = [
        _BEGIN.format(version=version),
        f"### LMCache {version}",
        "",
        "| # | EngineKVFormat | produced by | CPU | MLU | MUSA | why refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, spec in sorted(SPECS.items(), key=lambda item: int(item[0])):
        value = int(fmt)
        moved = served_as(value)
        cpu = moved is not None
        mlu = moved in MLU_FORMATS
        musa = moved in MUSA_MP_FORMATS
        why = refusal_reason(value) if not cpu else ""
        if cpu and not (mlu and musa):
            where = " and ".join(d for d, ok in (("MLU", mlu), ("MUSA", musa)) if not ok)
            why = f"on {where}: kvactors takes the formats LMCache's own ops move there"
        engines = " / ".join(spec.attention_backends)
        lines.append(
            f"| {value} | `{fmt.name}` | {engines} | {_cell(cpu)} | {_cell(mlu)} | "
            f"{_cell(musa)} | {why} |"
        )
    lines += ["", _END.format(version=version)]
    return "\n".join(lines)


def update(doc: str, version: str, new_section: str) -> str:
    """``doc`` with the section of ``version`` replaced by ``new_section`` (appended when the
    doc has none yet)."""
    pattern = re.compile(
        re.escape(_BEGIN.format(version=version)) + ".*?" + re.escape(_END.format(version=version)),
        re.DOTALL,
    )
    if pattern.search(doc):
        return pattern.sub(lambda _: new_section, doc)
    return doc.rstrip("\n") + "\n\n" + new_section + "\n"


def installed_version() -> str:
    """The installed LMCache's version (``0.5.6``, ``0.5.7rc2``)."""
    return importlib.metadata.version("lmcache")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the installed LMCache's section, or write it into the doc (``--write``)."""
    ap = argparse.ArgumentParser(prog="scripts/formats_table.py")
    ap.add_argument("--write", action="store_true", help=f"update the section in {DOC}")
    ap.add_argument("--doc", type=Path, default=DOC, help="the doc to update")
    args = ap.parse_args(argv)
    version = installed_version()
    text = section(version)
    if not args.write:
        print(text)
        return 0
    args.doc.write_text(update(args.doc.read_text(), version, text))
    print(f"updated the LMCache {version} section of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(DOC.parents[1]), str(DOC.parents[1] / "adapters")]  # this checkout's
    sys.exit(main())
