"""The per-call benchmark: the torch baseline makes the bytes kvactors' op makes, and every
row carries the ratios of issue 28 item 4 from the same run."""

from __future__ import annotations

import pytest
import torch

from kvactors.cli.bench import percall
from kvactors.cli.bench._pools import Pool
from kvactors.runtime import Runtime


@pytest.mark.parametrize("layout", ["nhd", "hnd", "mla", "kv_list"])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
def test_the_torch_call_moves_the_bytes_kvactors_moves(layout: str, gather: bool) -> None:
    torch.manual_seed(0)
    pools = [Pool("small", layout, 64, 4), Pool("small", layout, 64, 4)]
    stacks = [p.stack for p in pools if p.stack is not None]
    stacks[0].copy_(torch.randn(stacks[0].shape))
    stacks[1].copy_(stacks[0])
    for a, b in zip(pools[0].objects, pools[1].objects, strict=True):
        a.copy_(torch.randn(a.shape))
        b.copy_(a)
    before = (pools[0].objects[0] if gather else stacks[0]).clone()
    with Runtime("cpu") as rt:
        for c in (0, 3):  # each caller's first id set, in its own chunk
            percall._torch_call(pools[0], c, gather)()
            percall._kvactors_call(pools[1], c, gather, rt)[1]()
    assert torch.equal(stacks[0], stacks[1])
    for a, b in zip(pools[0].objects, pools[1].objects, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(before, pools[0].objects[0] if gather else stacks[0])  # it moved


def test_rows_carry_both_thread_counts_and_their_ratios() -> None:
    rows = percall.run_percall(cases=[("small", "mla")], calls=4, rounds=1)
    assert [(r.layout, r.direction) for r in rows] == [("mla", "gather"), ("mla", "scatter")]
    for r in rows:
        assert set(r.calls_per_s) == {"torch@1", "kvactors@1", "torch@4", "kvactors@4"}
        cps = r.calls_per_s
        assert r.vs_torch["1"] == r.us["kvactors@1"] / r.us["torch@1"]  # the median calls
        assert r.vs_torch["4"] == cps["torch@4"] / cps["kvactors@4"]  # aggregate calls/s
        assert r.scaling["kvactors"] == cps["kvactors@4"] / cps["kvactors@1"]
    assert "kva/t 1" in percall.format_percall(rows)


def test_without_lmcache_the_runtime_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    def needs_lmcache(*_: object) -> object:
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(percall, "baseline", lambda name: needs_lmcache)
    rows = percall.run_percall(cases=[("small", "nhd")], calls=2, rounds=1)
    assert {r.kvactors_via for r in rows} == {"runtime"}
    assert all(r.calls_per_s["kvactors@4"] > 0 for r in rows)
