"""The reply of an ask: one slot, settled once from any thread, then waited on or awaited.

The first settle (:meth:`Reply.settle`, ``cancel``) wins, atomically, from whichever thread
saw the outcome; every later one is a no-op. Three faces: :meth:`Reply.wait` sleeps the
calling thread (with a deadline); ``await reply`` under asyncio or trio, where the settling
thread never waits for the awaiting loop (on its thread it wakes the await in place, from
another it schedules the wake-up), and cancelling an await cancels the reply; ``Reply(then)``
calls ``then(exc, value)`` on the settling thread before the reply reads as done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final

from kvactors.errors import DeadlineExceededError, ProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

__all__ = ("Reply",)

T = TypeVar("T")
# The loop running on the calling thread, or None. asyncio's public ``get_running_loop``
# raises where none runs, and these checks run on every thread, on the call's path, where a
# raised and caught exception costs more than the check: the private function (the C one
# ``get_running_loop`` calls) answers None instead. Kept here, the module every actor module
# imports (the actor shell re-exports it), so it is named once.
running_loop = asyncio._get_running_loop


@final
class Reply(Generic[T]):
    """One ask's reply, settled once from any thread (see the module for its faces)."""

    __slots__ = ("_claims", "_done", "_exc", "_lock", "_then", "_value", "_wake")

    def __init__(self, then: Callable[[BaseException | None, Any], None] | None = None) -> None:
        self._claims = itertools.count()
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None
        self._then = then
        self._wake: Callable[[], None] | None = None  # an await's wake-up
        self._lock: threading.Lock | None = None  # held while the caller sleeps

    def done(self) -> bool:
        """Whether the reply was settled (or cancelled)."""
        return self._done

    def cancel(self) -> bool:
        """Drop the answer: settle with ``CancelledError``; ``False`` if settled already."""
        return self.settle(asyncio.CancelledError(), None)

    def settle(self, exc: BaseException | None, value: Any = None) -> bool:
        """Settle with ``exc``, else with ``value``; ``False`` (a no-op) if settled already."""
        # ``next`` on the counter is one atomic C call: of racing settles one writes.
        if self._done or next(self._claims):
            return False
        self._value, self._exc = value, exc
        try:
            if (then := self._then) is not None:
                then(exc, value)  # before the reply reads as done
        finally:
            self._done = True
            if (lock := self._lock) is not None:
                lock.release()
            if (wake := self._wake) is not None:
                wake()
        return True

    def result(self) -> T:
        """The value the reply was settled with, or raise its exception (``ProtocolError``
        before it is settled)."""
        if (exc := self.exception()) is not None:
            raise exc
        value: T = self._value
        return value

    def exception(self) -> BaseException | None:
        """The exception the reply was settled with (None for a value)."""
        if not self._done:
            raise ProtocolError("not settled yet", actor="reply", state="pending")
        return self._exc

    # ---- the blocking face -----------------------------------------------------------

    def wait(self, timeout: float, what: str) -> T:
        """Sleep until the reply is settled; return or raise it, or raise
        :class:`~kvactors.errors.DeadlineExceededError` (naming ``what``) past ``timeout``
        seconds."""
        if not self._done:
            lock = threading.Lock()
            lock.acquire()
            self._lock = lock  # published before the check: a settle releases it
            if not self._done:
                lock.acquire(timeout=timeout)
            if not self._done:
                raise DeadlineExceededError(actor="runtime", message_type=what, timeout=timeout)
        return self.result()

    # ---- the awaitable face ----------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        if not self._done or running_loop() is None:  # under trio every await checkpoints
            yield from self._park().__await__()
        return self.result()

    async def _park(self) -> None:
        loop, before = running_loop(), self._wake  # an earlier await is woken too
        if loop is not None:
            fut: asyncio.Future[None] = loop.create_future()
            self._wake = lambda: _wake_asyncio(loop, fut, before)
        else:
            import trio

            if self._done:
                await trio.lowlevel.checkpoint()
                return
            token, event = trio.lowlevel.current_trio_token(), trio.Event()
            self._wake = lambda: _wake_trio(token, event.set, before)
        if not self._done:  # checked after publishing the wake-up: a later settle calls it
            try:
                await (fut if loop is not None else event.wait())
            except BaseException:
                self.cancel()  # nobody wants the answer now
                raise


def _wake_asyncio(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], before: Callable[[], None] | None
) -> None:
    if running_loop() is loop:
        if not fut.done():
            fut.set_result(None)
    else:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits
            loop.call_soon_threadsafe(_wake_asyncio, loop, fut, None)
    if before is not None:
        before()


def _wake_trio(token: Any, wake: Callable[[], None], before: Callable[[], None] | None) -> None:
    import trio

    with contextlib.suppress(trio.RunFinishedError):  # the run ended: nobody awaits
        token.run_sync_soon(wake)
    if before is not None:
        before()
