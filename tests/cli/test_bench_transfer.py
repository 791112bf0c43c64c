"""The GB/s benchmark: kvactors, the raw copy and LMCache's torch path (a plugin: absent or
not importable, it is left out) on the same operands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvactors.cli._devenv import device_env
from kvactors.cli.bench import transfer

if TYPE_CHECKING:
    import pytest


def _rows() -> list[transfer.TransferRow]:
    with device_env("cpu") as env:
        return transfer.run_transfer(env, ["nhd", "kv_list"], reps=1, blocks=64, model="small")


def test_a_baseline_whose_lmcache_is_missing_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def needs_lmcache(*_: object) -> Any:
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(transfer, "baseline", lambda name: needs_lmcache)
    rows = _rows()
    assert [(r.layout, r.direction) for r in rows] == [
        ("nhd", "gather"), ("nhd", "scatter"), ("kv_list", "gather"), ("kv_list", "scatter")
    ]  # fmt: skip
    assert all(set(r.gbps) == {"kvactors", "raw"} for r in rows)


def test_the_baseline_is_timed_on_the_same_request(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []

    def fake_baseline(request: Any, paged: Any, objects: Any) -> Any:
        seen.append((request.direction, len(objects)))
        return lambda: None

    monkeypatch.setattr(transfer, "baseline", lambda name: fake_baseline)
    rows = _rows()
    assert all(r.gbps["lmcache"] > 0 for r in rows)
    assert seen == [(1, 4), (0, 4)] * 2  # both directions of both layouts, 4 chunks a call
    assert rows[0].nbytes == 4 * 2 * 8 * 256 * 4 * 64 * 2  # chunks x K/V x layers x tokens x ...
