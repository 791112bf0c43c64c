"""Thread bridges of the runtime facade: reply slots a foreign thread sleeps on, and the
settling of foreign futures from loop futures.

Theory of operation. A caller on a foreign thread must not touch the loop's futures. It hands
the actor a :class:`ReplyLock` (future-shaped, so actors settle it like any reply) and sleeps
on the lock; the actor settles it on the loop, which releases the lock and wakes the caller
directly, with no further loop iteration. Asyncio callers on another loop get a
``concurrent.futures.Future`` settled from the loop future (:func:`settle_concurrent`);
once such a caller cancelled, late answers are dropped.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kvactors.errors import ActorClosedError, DeadlineExceededError

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

__all__ = ("ReplyLock", "settle_concurrent", "settle_slot")


class ReplyLock:
    """A one-shot reply slot a foreign thread can sleep on (a pre-acquired lock).

    It has the shape of a future (``done``/``set_result``/``set_exception``), so actors settle
    it directly on the loop: the caller wakes without a further loop iteration.
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
            self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._exc = exc
            self._lock.release()

    def wait(self, timeout: float, what: str) -> Any:
        if not self._lock.acquire(timeout=timeout):
            raise DeadlineExceededError(actor="runtime", message_type=what, timeout=timeout)
        if self._exc is not None:
            raise self._exc
        return self._value


def settle_slot(fut: asyncio.Future[Any], slot: ReplyLock) -> None:
    if fut.cancelled():
        slot.set_exception(ActorClosedError("request cancelled", actor="runtime"))
    elif (exc := fut.exception()) is not None:
        slot.set_exception(exc)
    else:
        slot.set_result(fut.result())


def settle_concurrent(fut: asyncio.Future[Any], cf: concurrent.futures.Future[Any]) -> None:
    if cf.done():  # the caller cancelled its awaitable: nobody wants the answer
        return
    if fut.cancelled():
        cf.cancel()
    elif (exc := fut.exception()) is not None:
        cf.set_exception(exc)
    else:
        cf.set_result(fut.result())
