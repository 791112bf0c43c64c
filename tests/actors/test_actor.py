"""The actor shell: FIFO, tell/ask, deadlines, backpressure, closed and broken actors."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvactors.actors.actor import Actor, ActorState
from kvactors.actors.envelope import DEFERRED, Envelope
from kvactors.errors import (
    ActorBrokenError,
    ActorClosedError,
    DeadlineExceededError,
    MailboxFullError,
    UnknownMessageError,
)


class Put(msgspec.Struct, frozen=True, tag=True):
    value: int


class Boom(msgspec.Struct, frozen=True, tag=True):
    pass


class Hold(msgspec.Struct, frozen=True, tag=True):
    pass


class Other(msgspec.Struct, frozen=True, tag=True):
    pass


class Recorder(Actor[Any]):
    accepts = (Put, Boom, Hold)

    def __init__(self, capacity: int = 8) -> None:
        super().__init__("recorder", capacity=capacity)
        self.seen: list[int] = []
        self.gate = asyncio.Event()
        self.held: list[Any] = []

    def receive(self, env: Envelope[Any]) -> Any:
        msg = env.msg
        if isinstance(msg, Put):
            self.seen.append(msg.value)
            return msg.value * 2
        if isinstance(msg, Hold):
            self.held.append(self.defer(env))
            return DEFERRED
        raise RuntimeError("boom")


async def test_fifo_order_and_ask_reply() -> None:
    a = Recorder(capacity=64)
    a.start()
    for i in range(20):
        a.tell_nowait(Put(i))
    assert await a.ask_nowait(Put(99)) == 198
    assert a.seen == [*range(20), 99]
    stats = a.statistics()
    assert stats.processed == 21
    assert stats.failed == 0
    await a.stop()
    assert a.state is ActorState.STOPPED


async def test_unknown_message_rejected_before_queueing() -> None:
    a = Recorder()
    a.start()
    with pytest.raises(UnknownMessageError) as ei:
        a.tell_nowait(Other())
    assert ei.value.message_type == "Other"
    assert a.statistics().mailbox_depth == 0
    await a.stop()


async def test_full_mailbox_raises_and_drops_nothing() -> None:
    a = Recorder(capacity=4)
    a.start()
    holds = [a.ask_nowait(Hold()) for _ in range(4)]  # four replies in flight fill the bound
    with pytest.raises(MailboxFullError) as ei:
        a.tell_nowait(Put(4))
    assert ei.value.capacity == 4
    assert a.statistics().deferred_pending == 4
    waiting = asyncio.ensure_future(a.tell(Put(5)))  # waits for space instead of failing
    await asyncio.sleep(0)
    assert not waiting.done()
    a.held[0](None, "first")
    await waiting
    assert a.seen == [5]
    for settle in a.held[1:]:
        settle(None, "rest")
    assert [await h for h in holds] == ["first", "rest", "rest", "rest"]
    assert a.statistics().mailbox_peak == 4
    await a.stop()


async def test_message_sent_while_busy_waits_its_turn() -> None:
    order: list[str] = []

    class Reentrant(Actor[Any]):
        accepts = (Put,)

        def receive(self, env: Envelope[Any]) -> Any:
            order.append(f"start {env.msg.value}")
            if env.msg.value == 0:
                self.tell_nowait(Put(1))  # arrives while busy: queued, handled after
            order.append(f"end {env.msg.value}")

    a = Reentrant("reentrant")
    a.start()
    a.tell_nowait(Put(0))
    await a.drain()
    assert order == ["start 0", "end 0", "start 1", "end 1"]
    await a.stop()


async def test_ask_deadline() -> None:
    a = Recorder()
    a.start()
    with pytest.raises(DeadlineExceededError) as ei:
        await a.ask_nowait(Hold(), timeout=0.01)
    assert ei.value.message_type == "Hold"
    # The late answer is dropped without error.
    a.held[0](None, 1)
    await a.stop()


async def test_stop_fails_pending_asks_with_closed() -> None:
    a = Recorder()
    a.start()
    held = a.ask_nowait(Hold())
    await asyncio.sleep(0)
    await a.stop(graceful=False)
    with pytest.raises(ActorClosedError):
        await held
    with pytest.raises(ActorClosedError):
        a.tell_nowait(Put(1))
    with pytest.raises(ActorClosedError):
        await a.ask_nowait(Put(1))


async def test_ask_failure_fails_only_that_ask() -> None:
    a = Recorder()
    a.start()
    with pytest.raises(RuntimeError, match="boom"):
        await a.ask_nowait(Boom())
    assert await a.ask_nowait(Put(1)) == 2
    assert a.statistics().failed == 1
    await a.stop()


async def test_tell_failure_breaks_actor_with_cause() -> None:
    a = Recorder()
    a.start()
    in_flight = a.ask_nowait(Hold())
    a.tell_nowait(Boom())
    with pytest.raises(ActorBrokenError) as ei:
        await in_flight
    assert isinstance(ei.value.cause, RuntimeError)
    assert a.state is ActorState.BROKEN
    with pytest.raises(ActorBrokenError) as ei2:
        a.tell_nowait(Put(2))
    assert isinstance(ei2.value.__cause__, RuntimeError)
    await a.stop()


async def test_drain_waits_for_deferred_replies() -> None:
    a = Recorder()
    a.start()
    held = a.ask_nowait(Hold())
    drained = asyncio.ensure_future(a.drain())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not drained.done()
    a.held[0](None, "ok")
    await drained
    assert await held == "ok"
    await a.stop()


async def test_a_settle_on_another_thread_wakes_a_drain_and_a_waiting_tell() -> None:
    # The loop waits on its own events; only the settling thread's signal can wake it.
    a = Recorder(capacity=1)
    a.start()
    held = a.ask_nowait(Hold())
    waiting = asyncio.ensure_future(a.tell(Put(1)))  # the bound is full: waits for space
    await asyncio.sleep(0)
    assert not waiting.done()
    await asyncio.to_thread(a.held[0], None, "first")
    await asyncio.wait_for(waiting, 30)  # a hang guard, not a timing
    assert await held == "first"
    assert a.seen == [1]
    held = a.ask_nowait(Hold())
    drained = asyncio.ensure_future(a.drain())
    await asyncio.sleep(0)
    assert not drained.done()
    await asyncio.to_thread(a.held[1], None, "second")
    await asyncio.wait_for(drained, 30)
    assert await held == "second"
    await a.stop()
