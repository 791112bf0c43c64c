"""The ``a*`` API from any anyio backend: the same calls awaited under asyncio and trio."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

from kvactors.actors.reply import Reply
from kvactors.core.layouts import Direction
from kvactors.core.protocols.gather import Pong
from kvactors.errors import TransferValidationError
from kvactors.runtime import Runtime
from tests.scenarios._kv import expected_gather, objects, paged, request, same

if TYPE_CHECKING:
    from collections.abc import Callable

pytest.importorskip("trio")
IDS = (3, 5)
_HANG = 10.0  # bounds a wait only a hang exhausts; never decides a result


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_calls_await_under_every_anyio_backend(backend: str) -> None:
    host = paged(4)
    with Runtime("cpu") as rt:

        async def main() -> None:
            out = objects(1)
            store = rt.atransfer(request(Direction.D2H, IDS), host, out)
            fence = rt.afence(IDS)  # queued behind the store: waits for it
            done = await store
            assert (await fence).block_ids == IDS
            assert done.blocks == len(IDS)
            assert same(out[0], expected_gather(host, IDS)[0])
            assert (await rt.aping(7)).seq == 7
            with pytest.raises(TransferValidationError):
                await rt.atransfer(request(Direction.D2H, (99,)), host, objects(1))
            async with anyio.create_task_group() as tg:  # concurrent awaits
                chunks = [objects(1) for _ in range(4)]
                for c in chunks:
                    tg.start_soon(_await, rt.atransfer(request(Direction.D2H, IDS), host, c))
            for c in chunks:
                assert torch.equal(c[0], out[0])

        anyio.run(main, backend=backend)


async def _await(reply: object) -> None:
    await reply  # type: ignore[misc]


def test_a_cancelled_trio_await_drops_the_answer() -> None:
    host = paged(4)
    with Runtime("cpu") as rt:

        async def main() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await rt.atransfer(request(Direction.D2H, IDS), host, objects(1))
            assert scope.cancelled_caught
            assert (await rt.afence(IDS)).block_ids == IDS  # the runtime still serves

        anyio.run(main, backend="trio")


def _in_thread(fn: Callable[[], object]) -> object:
    # Runs ``fn`` on a thread of its own; a hang (the bug these tests guard) fails the join.
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(_HANG)
    assert not t.is_alive(), "the awaiting loop hung"
    return box[0]


def test_a_reply_made_off_loop_and_awaited_under_asyncio_never_blocks_the_loop() -> None:
    """An ``a*`` call made on a plain thread (no loop there) and awaited under asyncio: a
    reply settled already, one settled while awaited, and a cancelled await all return."""
    with Runtime("cpu") as rt:
        settled = rt.aping(1)
        assert _in_thread(lambda: asyncio.run(_await_value(settled))) == Pong(seq=1)

    reply: Reply[int] = Reply()  # made here: no running loop on this thread

    async def settled_while_awaited() -> int:
        waiter = asyncio.ensure_future(_await_value(reply))
        await asyncio.sleep(0)  # the await is parked on the reply
        threading.Thread(target=reply.settle, args=(None, 7)).start()
        return await waiter

    assert _in_thread(lambda: asyncio.run(settled_while_awaited())) == 7

    dropped: Reply[int] = Reply()

    async def cancelled() -> str:
        waiter = asyncio.ensure_future(_await_value(dropped))
        await asyncio.sleep(0)
        waiter.cancel()  # cancels the reply's future on the loop's own thread
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        return "cancelled"

    assert _in_thread(lambda: asyncio.run(cancelled())) == "cancelled"
    assert isinstance(dropped.exception(), asyncio.CancelledError)
    dropped.settle(None, 1)  # a late answer is dropped
    assert isinstance(dropped.exception(), asyncio.CancelledError)


def test_a_reply_is_settled_once_and_wakes_every_await() -> None:
    """The first settle wins (a cancel is one); ``then`` runs once, before the reply reads
    as done; two awaits of one reply both wake."""
    seen: list[tuple[object, object]] = []
    reply: Reply[int] = Reply(lambda exc, value: seen.append((exc, reply.done())))
    reply.settle(None, 1)
    reply.settle(RuntimeError("late"))
    assert not reply.cancel()
    assert reply.result() == 1
    assert seen == [(None, False)]

    twice: Reply[int] = Reply()

    async def both() -> list[int]:
        waits = [asyncio.ensure_future(_await_value(twice)) for _ in range(2)]
        await asyncio.sleep(0)  # both awaits are parked on the reply
        threading.Thread(target=twice.settle, args=(None, 5)).start()
        return list(await asyncio.gather(*waits))

    assert _in_thread(lambda: asyncio.run(both())) == [5, 5]


def test_settling_a_trio_reply_never_waits_for_the_trio_loop() -> None:
    """The thread that settles a reply awaited under trio only schedules the wake-up: it
    returns while trio's own thread is blocked (waiting for that very thread)."""
    trio = pytest.importorskip("trio")
    trio_testing = pytest.importorskip("trio.testing")
    reply: Reply[int] = Reply()

    async def main() -> int:
        got: list[int] = []

        async def wait() -> None:
            got.append(await reply)  # type: ignore[misc]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio_testing.wait_all_tasks_blocked()
            settler = threading.Thread(target=reply.settle, args=(None, 3))
            settler.start()
            settler.join(_HANG)  # blocks trio's thread: a settle that waits for it hangs
            assert not settler.is_alive(), "the settling thread waited for trio's loop"
        return got[0]

    assert trio.run(main) == 3


async def _await_value(reply: Any) -> Any:
    return await reply
