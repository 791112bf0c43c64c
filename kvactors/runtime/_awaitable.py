"""The replies of the ``a*`` calls, awaitable from any anyio backend (asyncio, trio).

An ``a*`` call queues its message at once and returns an awaitable of the reply, which lives
in a ``concurrent.futures.Future`` (:class:`~kvactors.runtime._bridge.FutureSlot`) that the actors
settle from whichever thread saw the outcome. Under asyncio the awaitable is
``asyncio.wrap_future`` of it (an ``asyncio.Future``: cancelling it drops the answer). Under
any other backend anyio runs (trio), it is :class:`AnyioReply`: awaiting it waits on an
``anyio.Event`` that the settling thread sets through ``anyio.from_thread.run_sync`` with the
awaiting loop's token; cancelling the awaiting task drops the answer too.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Awaitable, Generator

__all__ = ("AnyioReply", "reply_awaitable")

T = TypeVar("T")


class AnyioReply(Generic[T]):
    """The reply of an ``a*`` call under a non-asyncio anyio backend; await it once."""

    __slots__ = ("_cf",)

    def __init__(self, cf: concurrent.futures.Future[T]) -> None:
        self._cf = cf

    def done(self) -> bool:
        """Whether the reply was settled."""
        return self._cf.done()

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait().__await__()

    async def _wait(self) -> T:
        cf = self._cf
        if not cf.done():
            token = anyio.lowlevel.current_token()
            event = anyio.Event()

            def wake(_f: concurrent.futures.Future[T]) -> None:
                try:
                    anyio.from_thread.run_sync(event.set, token=token)
                except RuntimeError:  # settled on the awaiting loop's own thread
                    event.set()

            cf.add_done_callback(wake)
            try:
                await event.wait()
            except BaseException:
                cf.cancel()  # nobody wants the answer now
                raise
        else:
            await anyio.lowlevel.checkpoint()
        return cf.result()


def reply_awaitable(cf: concurrent.futures.Future[T]) -> Awaitable[T]:
    """``cf`` as an awaitable of the calling thread's async backend (see the module)."""
    if asyncio._get_running_loop() is not None:
        return asyncio.wrap_future(cf)
    return AnyioReply(cf)
