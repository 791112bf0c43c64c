"""The transfer benchmark: the LMCache baseline is optional (a plugin, absent or not
importable) and the C ceiling moves exactly the bytes kvactors moves."""

from __future__ import annotations

from typing import Any

import pytest

from kvactors.cli.bench import ceiling
from kvactors.cli.bench import transfer as bench_transfer
from kvactors.cli.bench.ceiling import ceiling_library
from kvactors.cli.bench.transfer import BenchWorkload, run_transfer_bench

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


@pytest.mark.parametrize("layout", bench_transfer.LAYOUTS)
def test_ceiling_moves_the_same_bytes_as_kvactors(layout: str) -> None:
    """The C ceiling copies between the very operands kvactors moves: its output must equal
    kvactors' bit for bit, both directions (else its speed would be of another transfer)."""
    import torch

    from kvactors.plans import paged_units

    if ceiling_library() is None:
        pytest.skip("no C compiler")
    setup = bench_transfer._Setup(layout, TINY, 0)
    units = paged_units(setup.spec, setup.paged)
    gen = torch.Generator().manual_seed(1)
    for u in units:
        u.copy_(torch.randn(u.shape, generator=gen).to(u.dtype))
    setup.kvactors(1)()
    expect = [o.clone() for o in setup.objects]
    moves = setup.ceilings(1)
    # gather_limit.c's access pattern: a block plane is one run except for HND (BS x NH runs,
    # walked in either order), MLA's one head included.
    assert len(moves) == (2 if layout == "hnd" else 1)
    for move in moves:
        for o in setup.objects:
            o.zero_()
        move()
        assert all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(expect, setup.objects, strict=True)
        )
    for o in setup.objects:
        o.copy_(torch.randn(o.shape, generator=gen).to(o.dtype))
    before = [u.clone() for u in units]
    setup.kvactors(0)()
    expect = [u.clone() for u in units]
    moves = setup.ceilings(0)
    assert moves
    for move in moves:
        for u, b in zip(units, before, strict=True):
            u.copy_(b)
        move()
        assert all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(expect, units, strict=True)
        )


def test_rows_carry_the_ceiling_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = run_transfer_bench(layouts=("hnd",), reps=1, workload=TINY, include_lmcache=False)
    if ceiling_library() is None:
        assert all(r.ceiling_gbps is None for r in rows)
    else:
        assert all(
            r.ceiling_gbps and r.vs_ceiling and r.ceiling_vs_raw and r.reused_vs_ceiling
            for r in rows
        )
    assert all(r.reused_gbps and r.reused_gbps > 0 for r in rows)
    monkeypatch.setattr(ceiling, "_LIB", [None])  # no compiler: the columns are left out
    rows = run_transfer_bench(layouts=("hnd",), reps=1, workload=TINY, include_lmcache=False)
    assert all(r.ceiling_gbps is None and r.vs_ceiling is None for r in rows)
