"""The one-chunk part of ``kvactors bench`` (issue 41 slice 4): its contenders, thread counts,
ratios and JSON on CPU and on a fake vendor, the exactness check, and failed cases kept apart.
Structure only: speed is measured by the bench, never asserted here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from kvactors.cli._devenv import device_env
from kvactors.cli.bench import transfer

if TYPE_CHECKING:
    from collections.abc import Callable

CONTENDERS = {"raw", "bare", "kvactors", "kvactors_async"}


def _rows(layouts: list[str], device: str = "cpu") -> list[transfer.TransferRow]:
    with device_env(device) as env:
        return transfer.run_transfer(env, layouts, reps=2, rounds=1, blocks=128, model="small")


def _no_lmcache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "baseline", lambda name: None)


def test_every_contender_at_one_and_four_threads_on_one_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_lmcache(monkeypatch)
    rows = _rows(["nhd", "nhd_separate"])
    assert [(r.layout, r.direction) for r in rows] == [
        ("nhd", "gather"), ("nhd", "scatter"), ("nhd_separate", "gather"),
        ("nhd_separate", "scatter"),
    ]  # fmt: skip
    for r in rows:
        assert r.error == ""
        assert r.exact is True
        assert r.nbytes == 2 * 8 * 256 * 4 * 64 * 2  # one chunk: K/V x layers x tokens x ...
        names = CONTENDERS - ({"bare"} if r.layout == "nhd_separate" else set())
        assert set(r.timings) == {f"{n}@{t}" for n in names for t in (1, 4)}
        for t in r.timings.values():
            assert t.gbps > 0
            assert t.calls_per_s > 0
            assert 0 < t.host_us <= t.done_us
            assert t.device_us is None
            assert t.busy_us is None
        assert r.ratios["kvactors done/busy"] is None
        assert r.ratios["kvactors/raw@4"] == pytest.approx(
            r.timings["kvactors@4"].gbps / r.timings["raw@4"].gbps
        )
        assert r.ratios["kvactors 4/1"] == pytest.approx(
            r.timings["kvactors@4"].gbps / r.timings["kvactors@1"].gbps
        )
    assert rows[2].ratios["kvactors/bare@1"] is None  # no bare route without a stacked pool
    # The JSON round-trips with its nulls.
    data = msgspec.json.decode(msgspec.json.encode(rows), type=list[transfer.TransferRow])
    assert data == rows


def test_on_a_fake_vendor_the_device_has_timing_events() -> None:
    rows = _rows(["mla"], "musa")
    assert [r.error for r in rows] == ["", ""]
    for r in rows:
        assert r.simulated
        assert r.pinned
        assert r.exact is True
        # Device time from events in a pass of its own, one caller: none in timed windows.
        for key, t in r.timings.items():
            if key.endswith("@1"):
                assert t.device_us is not None, key
                assert t.device_us > 0, key
            else:
                assert t.device_us is None, key
        assert all(t.busy_us is None for t in r.timings.values())  # no spin kernel on a fake


def test_the_block_sets_never_repeat_a_block() -> None:
    sets = transfer.block_sets(200, 16, 4)
    assert len(sets) == 12
    assert all(len(s) == 16 for s in sets)
    flat = [b for s in sets for b in s]
    assert len(set(flat)) == len(flat)
    assert sorted(flat) != flat  # shuffled


def test_a_route_that_moves_wrong_bytes_is_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_lmcache(monkeypatch)
    real = transfer._contenders

    def broken(*args: Any) -> dict[str, Callable[[], object]]:
        fns = real(*args)
        fns["bare"] = lambda: None  # neither gathers nor scatters
        return fns

    monkeypatch.setattr(transfer, "_contenders", broken)
    assert [r.exact for r in _rows(["mla"])] == [False, False]


def test_a_baseline_whose_lmcache_is_missing_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def needs_lmcache(*_: object) -> Any:
        raise ModuleNotFoundError("No module named 'lmcache'")

    monkeypatch.setattr(transfer, "baseline", lambda name: needs_lmcache)
    rows = _rows(["kv_list"])
    assert all(set(r.timings) == {f"{n}@{t}" for n in CONTENDERS for t in (1, 4)} for r in rows)


def test_the_baseline_is_timed_on_one_chunk_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []

    def fake_baseline(request: Any, paged: Any, objects: Any) -> Any:
        seen.append((request.direction, len(objects), len(request.block_ids)))
        return lambda: None

    monkeypatch.setattr(transfer, "baseline", lambda name: fake_baseline)
    rows = _rows(["mla"])
    assert all(r.timings["lmcache@4"].gbps > 0 for r in rows)
    assert rows[0].ratios["kvactors/lmcache@1"] is not None
    assert seen == [(1, 1, 16)] * 5 + [(0, 1, 16)] * 5  # 1 + 4 callers per direction


def test_a_failed_case_is_a_row_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_lmcache(monkeypatch)
    real = transfer._case

    def fail_scatter(*args: Any) -> Any:
        if not args[4]:
            raise RuntimeError("no scatter here")
        return real(*args)

    monkeypatch.setattr(transfer, "_case", fail_scatter)
    rows = _rows(["mla"])
    assert rows[0].error == ""
    assert rows[0].timings
    assert rows[1].error == "RuntimeError: no scatter here"
    assert rows[1].timings == {}
    text = transfer.format_transfer(rows)
    assert "mla scatter not measured: RuntimeError: no scatter here" in text
    assert text.splitlines()[0].startswith("one-chunk calls on cpu")


def test_with_a_spin_kernel_the_busy_time_and_its_ratio_are_filled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA holds the stream with ``_sleep``; a fake has none, so give it a no-op one: the
    # busy pass then runs (events around each call behind the spin) on the fake's streams.
    spun: list[int] = []

    class Spinning(transfer._Dev):
        def __init__(self, env: Any) -> None:
            super().__init__(env)
            self.spin = spun.append

    monkeypatch.setattr(transfer, "_Dev", Spinning)
    rows = _rows(["nhd"], "musa")
    assert len(spun) == 2 * 3 * 8  # two directions x (raw, bare, kvactors_async) x 8 calls
    for r in rows:
        busy = {k for k, t in r.timings.items() if t.busy_us is not None}
        assert busy == {"raw@1", "bare@1", "kvactors_async@1"}
        assert r.ratios["kvactors done/busy"] is not None
        assert r.ratios["bare done/busy"] is not None
