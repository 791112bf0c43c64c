"""The transfer benchmark: the LMCache baseline is optional (a plugin, absent or not
importable)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvactors.cli.bench import transfer as bench_transfer
from kvactors.cli.bench.transfer import BenchWorkload, run_transfer_bench

if TYPE_CHECKING:
    import pytest

TINY = BenchWorkload(
    num_layers=2,
    block_size=4,
    num_heads=2,
    head_size=8,
    mla_hs=16,
    chunk_tokens=8,
    chunks_per_call=2,
    num_blocks=32,
)


def _run() -> list[Any]:
    return run_transfer_bench(layouts=("nhd",), reps=1, workload=TINY, include_lmcache=True)


def test_baseline_whose_lmcache_is_missing_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def needs_lmcache(*_: object) -> Any:
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(bench_transfer, "_baseline", lambda name: needs_lmcache)
    rows = _run()
    assert [r.direction for r in rows] == ["gather", "scatter"]
    assert all(r.lmcache_gbps is None and r.vs_lmcache is None for r in rows)


def test_baseline_is_timed_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_baseline(request: Any, paged: Any, objects: Any) -> Any:
        return lambda: calls.append(request.direction)

    monkeypatch.setattr(bench_transfer, "_baseline", lambda name: fake_baseline)
    rows = _run()
    assert all(r.lmcache_gbps is not None and r.lmcache_gbps > 0 for r in rows)
    assert set(calls) == {0, 1}
