"""The bench's one harness: lanes run at once on their own threads, windows rotate, errors
reach the caller as themselves, every call is timed under its tag."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING

import pytest

from kvactors.cli.bench._harness import Lane, rates

if TYPE_CHECKING:
    from collections.abc import Iterator


def test_the_lanes_of_a_contender_run_at_once_each_on_its_own_thread() -> None:
    # Each call waits for the other three lanes' calls: lanes run one after another would
    # break the barrier (BrokenBarrierError out of rates).
    meet = threading.Barrier(4, timeout=10)
    seen: set[int] = set()

    def call() -> None:
        seen.add(threading.get_ident())
        meet.wait()

    got = rates({"x": [Lane([("call", call)]) for _ in range(4)]}, calls=3, rounds=2)
    assert len(seen) == 4
    assert got["x"].calls_per_s > 0
    assert set(got["x"].p50_us) == {"call"}


def test_a_single_lane_runs_on_the_calling_thread_inside_its_context() -> None:
    where: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        where.append(("enter", threading.get_ident()))
        yield

    lane = Lane([("a", lambda: where.append(("a", threading.get_ident())))], context=context)
    rates({"x": [lane]}, calls=2, rounds=1)
    assert {ident for _, ident in where} == {threading.get_ident()}
    assert [w for w, _ in where] == ["enter", "a", "a", "enter", "a", "a"]  # warm-up, round


def test_windows_rotate_so_two_contenders_run_abba() -> None:
    order: list[str] = []
    lanes = {
        k: [Lane([("c", lambda: None)], done=functools.partial(order.append, k))] for k in "AB"
    }
    rates(lanes, calls=1, rounds=4)
    assert "".join(order) == "AB" + "ABBAABBA"  # the warm-up windows, then the rounds


def test_tags_split_the_host_times_and_calls_per_window_are_counted() -> None:
    counts = {"store": 0, "retrieve": 0}

    def bump(tag: str) -> None:
        counts[tag] += 1

    mix = [("store", lambda: bump("store"))] * 3 + [("retrieve", lambda: bump("retrieve"))]
    got = rates({"x": [Lane(mix)]}, calls=8, rounds=2)
    # The warm-up window (2 calls: store, store), then 2 windows of 8 calls cycling the mix.
    assert counts == {"store": 2 + 2 * 6, "retrieve": 2 * 2}
    assert set(got["x"].p50_us) == {"store", "retrieve"}
    assert got["x"].p50_us["store"] > 0


def test_an_error_in_any_lane_reaches_the_caller_as_itself() -> None:
    class Boom(Exception):
        pass

    def fail() -> None:
        raise Boom

    lanes = [Lane([("c", lambda: None)]), Lane([("c", fail)])]
    with pytest.raises(Boom):
        rates({"x": lanes}, calls=2, rounds=1)
