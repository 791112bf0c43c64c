"""kvactors bench --quick on one layout: the figures, the JSON and the PNG are written."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from kvactors.cli import main

if TYPE_CHECKING:
    import pathlib


def test_bench_tiny(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    rc = main(["bench", "--quick", "--layouts", "NHD", "--reps", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "bench.json").read_text())
    assert [(r["layout"], r["direction"]) for r in data["transfer"]] == [
        ("nhd", "gather"),
        ("nhd", "scatter"),
    ]
    for r in data["transfer"]:
        assert r["kvactors_gbps"] > 0
        assert r["raw_gbps"] > 0
    assert {r["direction"] for r in data["runtime"]} == {"gather", "scatter"}
    # The vendor part: kvactors' device ops per call on both fake vendors, each layout.
    ours = [r for r in data["vendor"] if r["contender"] == "kvactors"]
    assert {(r["vendor"], r["layout"]) for r in ours} >= {("mlu", "HND"), ("musa", "KV lists")}
    assert all(r["counts"]["d2h"] + r["counts"]["h2d"] >= r["chunks"] for r in ours)
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert "1/" in captured.err  # the progress bar


def test_bench_rejects_unknown_layout(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--quick", "--layouts", "nope", "--out", str(tmp_path)])
