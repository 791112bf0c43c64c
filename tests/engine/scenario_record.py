"""Per-scenario figures of the deployment tests, for the closing note and docs/deployment.md.

``KVACTORS_SERVED_RESULTS=DIR`` makes every scenario write ``DIR/<scenario>.json`` (requests,
hits, bytes compared, failures); without it nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS_ENV = "KVACTORS_SERVED_RESULTS"


def record(scenario: str, figures: dict[str, Any]) -> None:
    """Write ``figures`` for ``scenario`` when ``KVACTORS_SERVED_RESULTS`` names a directory."""
    where = os.environ.get(RESULTS_ENV, "").strip()
    if not where:
        return
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{scenario}.json").write_text(json.dumps(figures, indent=1))


def tap_totals(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The tap reports of one scenario, summed."""
    keys = ("chunks_stored", "chunks_restored", "chunks_compared", "chunks_unknown",
            "layer_blocks_compared", "bytes_compared", "differential_chunks")  # fmt: skip
    out: dict[str, Any] = {k: sum(int(r[k]) for r in reports) for k in keys}
    out["mismatches"] = sum(len(r["mismatches"]) for r in reports)
    out["differential_mismatches"] = sum(len(r["differential_mismatches"]) for r in reports)
    out["processes"] = len({r["pid"] for r in reports})
    return out
