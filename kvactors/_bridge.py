"""Thread bridges of the runtime facade: reply slots that any thread may settle.

A caller on a foreign thread hands the actor a :class:`ReplyLock` (future-shaped, so actors
settle it like any reply) and sleeps on the lock; whichever thread settles it (the caller
itself when it ran the turn, a lane or reaper thread, the loop) releases the lock and wakes the
caller directly. Asyncio callers get a :class:`FutureSlot`, a ``concurrent.futures.Future``
their loop awaits through ``asyncio.wrap_future``; once such a caller cancelled, late answers
are dropped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from kvactors.errors import ActorClosedError, DeadlineExceededError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("FutureSlot", "ReplyLock", "settle_slot")


class ReplyLock:
    """A one-shot reply slot a foreign thread can sleep on (a pre-acquired lock), and that
    thread's :class:`~kvactors.actors.actor.Waiter`.

    It has the shape of a future (``done``/``set_result``/``set_exception``); the first settle
    wins, from any thread. While the caller sleeps in :meth:`wait`, an actor may hand it a turn
    (:meth:`hand`): the caller wakes, runs the turn on its own thread, and sleeps again. A
    caller that leaves (a result, or its deadline) refuses later hand-offs, atomically with its
    check for one: a turn handed to it is always run.
    """

    __slots__ = ("_done", "_exc", "_gone", "_lock", "_mutex", "_turn", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._mutex = threading.Lock()  # the settle, and the hand-off against the caller leaving
        self._done = False
        self._gone = False
        self._turn: Callable[[], None] | None = None
        self._value: Any = None
        self._exc: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def _settle(self, value: Any, exc: BaseException | None) -> None:
        with self._mutex:
            if self._done:
                return
            self._value, self._exc = value, exc
            self._done = True
        with contextlib.suppress(RuntimeError):  # a hand-off released it already
            self._lock.release()

    def hand(self, turn: Callable[[], None]) -> bool:
        """Give the sleeping caller ``turn`` to run; ``False`` if it left already."""
        with self._mutex:
            if self._gone:
                return False
            self._turn = turn
        with contextlib.suppress(RuntimeError):  # a settle released it already
            self._lock.release()
        return True

    def _take(self, leave: bool) -> Callable[[], None] | None:
        # The turn handed over, if any; with ``leave``, refuse every later one if none was.
        with self._mutex:
            turn, self._turn = self._turn, None
            if leave and turn is None:
                self._gone = True
            return turn

    def wait(self, timeout: float, what: str) -> Any:
        """Sleep until the reply is settled (running the turns handed over meanwhile); raise
        it, or :class:`~kvactors.errors.DeadlineExceededError` past ``timeout`` seconds."""
        end: float | None = None
        while True:
            if self._done or (end is not None and time.monotonic() >= end):
                turn = self._take(leave=True)
                if turn is None:
                    break
            else:
                turn = self._take(leave=False)
                if turn is None:
                    if end is None:
                        end = time.monotonic() + timeout
                    self._lock.acquire(timeout=max(0.0, end - time.monotonic()))
                    continue
            turn()
        if not self._done:
            raise DeadlineExceededError(actor="runtime", message_type=what, timeout=timeout)
        if self._exc is not None:
            raise self._exc
        return self._value


class FutureSlot:
    """A reply slot over a ``concurrent.futures.Future`` (``cf``); the first settle wins, and
    a settle after the awaiting side cancelled is dropped."""

    __slots__ = ("cf",)

    def __init__(self) -> None:
        self.cf: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(self) -> bool:
        return self.cf.done()

    def set_result(self, value: Any) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.cf.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.cf.set_exception(exc)


def settle_slot(fut: concurrent.futures.Future[Any], slot: ReplyLock) -> None:
    """Settle ``slot`` as ``fut`` ended (a cancelled ``fut`` as a closed request)."""
    if fut.cancelled():
        slot.set_exception(ActorClosedError("request cancelled", actor="runtime"))
    elif (exc := fut.exception()) is not None:
        slot.set_exception(exc)
    else:
        slot.set_result(fut.result())
