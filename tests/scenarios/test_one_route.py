"""One route: every call takes the same actors and messages on CPU and on both fake devices,
observed or not, and a call's device work runs on few host threads.

The acceptance test replays one script of requests (stores, retrieves, a fence, a refused
request, records, a barrier, ``a*`` calls) on CPU, the fake MLU and the fake MUSA, each with
and without an observer, and compares what the actors did: per actor (named without its
device) the messages processed and failed, the observed calls in admission order with their
outcome, the published completions, and the transfer counters. A device- or observer-specific
bypass of an actor changes its counts and fails the comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import Direction
from kvactors.errors import TransferValidationError
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios._kv import expected_gather, objects, paged, request, same

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvactors.devices.base import Backend
    from kvactors.runtime.observer import Call
    from kvactors.testing import FakeVendor

IDS = (3, 5)


def _backend(kind: str) -> Backend | str:
    if kind == "mlu":
        from kvactors.devices.mlu.backend import MluBackend

        return MluBackend(layout_source="resolved")  # the engine resolved NHD explicitly
    return kind


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, int, str, str]] = []

    def call_started(self, call: Call) -> None:
        with self.lock:
            self.events.append(("started", call.seq, call.op, ""))

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        with self.lock:
            outcome = type(error).__name__ if error is not None else type(result).__name__
            self.events.append(("finished", call.seq, call.op, outcome))


@contextlib.contextmanager
def _device(kind: str) -> Iterator[FakeVendor | None]:
    if kind == "cpu":
        yield None
    else:
        with fake_vendor(kind, seed=3) as fake:
            yield fake


def _script(kind: str, observed: bool) -> dict[str, Any]:
    with _device(kind) as fake:
        host = paged(4)
        layers = host if fake is None else [fake.adopt(t.clone()) for t in host]
        log = _Log()
        with Runtime(_backend(kind), observer=log if observed else None) as rt:
            out = objects(1)
            rt.transfer(request(Direction.D2H, IDS), layers, out)
            assert same(out[0], expected_gather(host, IDS)[0])
            rt.transfer(request(Direction.H2D, IDS), layers, objects(1, 2.0))
            rt.fence(IDS, timeout=10)
            with pytest.raises(TransferValidationError):
                rt.transfer(request(Direction.D2H, (99,)), layers, objects(1))
            rt.record_completion(0, "stored", b"1")
            rt.synchronize()

            async def twins() -> None:
                back = objects(1)
                store = rt.atransfer(request(Direction.D2H, IDS), layers, back)
                fence = rt.afence(IDS, timeout=10)
                await store
                await fence
                assert torch.equal(back[0], torch.full_like(back[0], 2.0))

            asyncio.run(twins())
            rt.synchronize()
            stats = rt.statistics()
            completions = rt.drain_completions()
        actors = sorted(
            (a.name.split(":", 1)[0], a.processed, a.failed, a.deferred_pending)
            for a in stats.actors
        )
        with log.lock:
            events = sorted(log.events, key=lambda e: (e[1], e[0] != "started"))
        return {
            "actors": actors,
            "calls": events,
            "completions": completions,
            "transfers": (stats.transfers_ok, stats.transfers_failed, stats.inflight),
        }


def test_the_same_requests_take_the_same_actors_on_every_device_observed_or_not() -> None:
    runs = {(k, o): _script(k, o) for k in ("cpu", "mlu", "musa") for o in (False, True)}
    reference = runs["cpu", True]
    assert reference["calls"], "the observer saw nothing"
    assert reference["transfers"] == (3, 0, 0)
    for key, run in runs.items():
        observed = key[1]
        assert run["actors"] == reference["actors"], key
        assert run["completions"] == reference["completions"], key
        assert run["transfers"] == reference["transfers"], key
        assert run["calls"] == (reference["calls"] if observed else []), key


def _ops_threads(kind: str, complete: bool, call: Callable[[Runtime, Any], None]) -> set[str]:
    with fake_vendor(kind, seed=5) as fake:
        layers = [fake.adopt(t) for t in paged(2)]
        with Runtime(_backend(kind)) as rt:
            call(rt, layers)  # warm: the stream actor and its plan exist
            rt.synchronize()
            device = {t.name for t in fake.threads()}
            with fake.counting() as ops:
                call(rt, layers)
            rt.synchronize()
            assert ops.counts.copies >= 1
            return set(ops.threads) - device


@pytest.mark.parametrize("kind", ["mlu", "musa"])
@pytest.mark.parametrize("complete", [False, True], ids=["enqueued", "complete"])
def test_a_call_with_idle_actors_makes_at_most_two_thread_hand_offs(
    kind: str, complete: bool
) -> None:
    """The host work of a call with idle actors (validation, planning, every enqueue) runs on
    the calling thread: no hand-off before the copies are enqueued. Waiting for completion
    adds one thread, the stream's reaper, which waits for the device's marker and wakes the
    caller: two hand-offs (caller -> reaper -> caller), never the event loop's thread."""

    def store(rt: Runtime, layers: Any) -> None:
        rt.transfer(
            request(Direction.D2H, IDS),
            layers,
            [o.pin_memory() for o in objects(1)],
            complete=complete,
        )

    caller = threading.current_thread().name
    threads = _ops_threads(kind, complete, store)
    if complete:
        assert threads == {caller, f"reap:stream:{kind}:0:0x0"}
    else:
        assert threads == {caller}
