"""``kvactors bench``: every part on a small run, the JSON and the PNG written."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from kvactors.cli import build_parser, main

if TYPE_CHECKING:
    import pathlib


def test_bench_writes_every_part(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--quick",
        "--layouts",
        "MLA",
        "--reps",
        "1",
        "--calls",
        "4",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert [(r["layout"], r["direction"]) for r in data["transfer"]] == [
        ("mla", "gather"),
        ("mla", "scatter"),
    ]
    for r in data["transfer"]:
        assert r["timings"]["kvactors@1"]["gbps"] > 0
        assert r["timings"]["raw@4"]["gbps"] > 0
        assert r["exact"] is True
    assert data["meta"]["transfer_model"] == "small"
    assert [(r["model"], r["layout"]) for r in data["percall"]] == [("small", "mla")] * 2
    # The fake vendors: both contenders per layout LMCache serves, or a reason each is left out.
    vendors = {r["vendor"] for r in data["vendor"]}
    left_out = {line.split(":")[0] for line in data["meta"]["vendors_left_out"]}
    assert vendors | left_out == {"mlu", "musa"}
    for r in data["vendor"]:
        assert set(r["host_us"]) == set(r["calls_per_s"]) == {"1", "4", "ld"}
    assert {r["contender"] for r in data["vendor"]} <= {"kvactors", "lmcache"}
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert "per call on CPU" in captured.out
    assert "one-chunk calls on cpu" in captured.out
    assert "[1/" in captured.err  # the progress lines


def test_bench_percall_alone(tmp_path: pathlib.Path) -> None:
    argv = ["bench", "--percall", "--no-vendor", "--layouts", "nhd", "--calls", "2", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["transfer"] == []
    assert [(r["model"], r["direction"]) for r in data["percall"]] == [
        ("small", "gather"), ("small", "scatter"), ("8b", "gather"), ("8b", "scatter")
    ]  # fmt: skip
    assert not (tmp_path / "bench.png").exists()


def test_bench_rejects_unknown_layout(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--quick", "--layouts", "nope", "--out", str(tmp_path)])


def test_the_help_names_only_commands_that_exist() -> None:
    import argparse
    import re

    import kvactors.cli

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    named = set(re.findall(r"``([a-z-]+)``", (kvactors.cli.__doc__ or "").split("\n\n")[0]))
    assert named - {"kvactors"} == commands  # the command table, no more, no less
    assert "hotpath" not in parser.format_help()


def test_the_benchmarks_page_is_one_table_of_figures_with_their_commands() -> None:
    # Issue 38 item 7: docs/benchmarks.md at most 150 lines, one table of current figures,
    # each row with the command that measures it.
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 150
    rows = [ln for ln in page.splitlines() if ln.startswith("| ") and not ln.startswith("| #")]
    assert len(rows) >= 10
    assert all(ln.rstrip(" |").rsplit("|", 1)[-1].strip() for ln in rows)  # a command each
    assert sum(ln.startswith("| # |") for ln in page.splitlines()) == 1  # one table
