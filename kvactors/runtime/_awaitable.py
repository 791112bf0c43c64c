"""The replies of the ``a*`` calls, awaitable from any anyio backend (asyncio, trio).

An ``a*`` call queues its message at once and returns an awaitable of the reply, which lives
in a ``concurrent.futures.Future`` (:class:`~kvactors.runtime._bridge.FutureSlot`) that the actors
settle from whichever thread saw the outcome. Made on a thread running an asyncio loop, the
awaitable is ``asyncio.wrap_future`` of it. Made anywhere else (trio, or a plain thread whose
reply is awaited later), it is :class:`Reply`, which picks the awaiting loop's wake-up when it
is awaited: ``loop.call_soon_threadsafe`` under asyncio, ``TrioToken.run_sync_soon`` under
trio.
Either way the settling thread only schedules the wake-up, never waits for the awaiting loop,
and cancelling the await drops the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Awaitable, Generator

__all__ = ("Reply", "reply_awaitable")

T = TypeVar("T")


class Reply(Generic[T]):
    """The reply of an ``a*`` call made off an asyncio loop; await it once, from asyncio or
    trio."""

    __slots__ = ("_cf",)

    def __init__(self, cf: concurrent.futures.Future[T]) -> None:
        self._cf = cf

    def done(self) -> bool:
        """Whether the reply was settled."""
        return self._cf.done()

    def __await__(self) -> Generator[Any, None, T]:
        if asyncio._get_running_loop() is not None:
            return self._asyncio_wait().__await__()
        return self._trio_wait().__await__()

    async def _asyncio_wait(self) -> T:
        cf = self._cf
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def wake(_f: concurrent.futures.Future[T]) -> None:
            # Schedules, from any thread (the loop's own included), and never waits.
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits
                loop.call_soon_threadsafe(_copy, cf, fut)

        cf.add_done_callback(wake)
        try:
            return await fut
        except BaseException:
            cf.cancel()  # nobody wants the answer now
            raise

    async def _trio_wait(self) -> T:
        import trio

        cf = self._cf
        if cf.done():
            await trio.lowlevel.checkpoint()
            return cf.result()
        token = trio.lowlevel.current_trio_token()
        event = trio.Event()

        def wake(_f: concurrent.futures.Future[T]) -> None:
            # Schedules, from any thread, and never waits; a run that ended has nobody to wake.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)

        cf.add_done_callback(wake)
        try:
            await event.wait()
        except BaseException:
            cf.cancel()  # nobody wants the answer now
            raise
        return cf.result()


def _copy(cf: concurrent.futures.Future[T], fut: asyncio.Future[T]) -> None:
    # On the awaiting loop: the settled reply into the awaited future (unless cancelled).
    if fut.done():
        return
    if cf.cancelled():
        fut.cancel()
    elif (exc := cf.exception()) is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(cf.result())


def reply_awaitable(cf: concurrent.futures.Future[T]) -> Awaitable[T]:
    """``cf`` as an awaitable (see the module)."""
    if asyncio._get_running_loop() is not None:
        return asyncio.wrap_future(cf)
    return Reply(cf)
