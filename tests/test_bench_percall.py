"""The per-call benchmark runs its contenders on identical shapes and reports ratios."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import msgspec
import pytest

from kvactors.cli.bench.percall import format_percall, main, run_percall_bench

if TYPE_CHECKING:
    from pathlib import Path


def test_percall_rows_compare_every_contender_with_the_single_torch_call() -> None:
    report = run_percall_bench(
        models=("small",), layouts=("nhd", "mla", "fused"), callers=(1, 2), reps=2, quick=True
    )
    expected = []
    for lay in ("nhd", "mla", "fused"):
        for c in (1, 2):
            for d in ("gather", "scatter"):
                expected.append((lay, d, c, "same"))
                if c == 1:  # single callers also run with other block ids on every call,
                    expected.append((lay, d, c, "fresh"))  # and with other chunk buffers too
                    expected.append((lay, d, c, "bufs"))
    assert [(r.layout, r.direction, r.callers, r.ids) for r in report.rows] == expected
    for r in report.rows:
        assert {"torch", "runtime"} <= set(r.p50_us)
        assert r.vs_torch["runtime"] == pytest.approx(
            r.calls_per_s["torch"] / r.calls_per_s["runtime"]
        )
        assert r.p99_us["runtime"] >= r.p50_us["runtime"] > 0
    assert report.plan_cold_us > 0
    assert report.plan_warm_us > 0
    assert "planning: warm" in format_percall(report)


def test_percall_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "percall.json"
    assert (
        main(
            [
                "--models",
                "small",
                "--layouts",
                "nhd",
                "--directions",
                "gather",
                "--callers",
                "1",
                "--reps",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    report = msgspec.convert(data, type=dict)
    assert report["rows"][0]["layout"] == "nhd"
