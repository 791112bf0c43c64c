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
from typing import Any

from kvactors.errors import ActorClosedError, DeadlineExceededError

__all__ = ("FutureSlot", "ReplyLock", "settle_slot")


class ReplyLock:
    """A one-shot reply slot a foreign thread can sleep on (a pre-acquired lock).

    It has the shape of a future (``done``/``set_result``/``set_exception``); the first settle
    wins, from any thread.
    """

    __slots__ = ("_done", "_exc", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        if not self._done:
            self._done = True
            self._value = value
            with contextlib.suppress(RuntimeError):  # a racing settle released it first
                self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._exc = exc
            with contextlib.suppress(RuntimeError):  # a racing settle released it first
                self._lock.release()

    def wait(self, timeout: float, what: str) -> Any:
        if not self._lock.acquire(timeout=timeout):
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
