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
import itertools
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
    wins, from any thread. Once a message of the caller queued behind a busy actor
    (:meth:`enlist`), an actor may hand it a turn while it sleeps in :meth:`wait` (:meth:`hand`):
    the caller wakes, runs the turn on its own thread, and sleeps again. A caller that leaves
    (a result, or its deadline) refuses later hand-offs, atomically with its check for one: a
    turn handed to it is always run.
    """

    __slots__ = ("_claims", "_done", "_exc", "_gone", "_lock", "_mutex", "_turn", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._claims = itertools.count()
        self._value: Any = None
        self._exc: BaseException | None = None
        # Made by ``enlist``: guards the hand-off against the caller leaving.
        self._mutex: threading.Lock | None = None
        self._gone = False
        self._turn: Callable[[], None] | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        # The first settle wins: ``next`` on the claim counter is one atomic step (a C call
        # under the GIL), so of two racing settles exactly one writes the reply.
        if not self._done and next(self._claims) == 0:
            self._value = value
            self._done = True
            try:  # noqa: SIM105 (the per-call path: no context manager)
                self._lock.release()
            except RuntimeError:  # a hand-off released it already
                pass

    def set_exception(self, exc: BaseException) -> None:
        if not self._done and next(self._claims) == 0:
            self._exc = exc
            self._done = True
            with contextlib.suppress(RuntimeError):  # a hand-off released it already
                self._lock.release()

    def enlist(self) -> None:
        """A message of the caller queued (called on the caller's thread, before it waits):
        from now on a turn may be handed over."""
        if self._mutex is None:
            self._mutex = threading.Lock()

    def hand(self, turn: Callable[[], None]) -> bool:
        """Give the sleeping caller ``turn`` to run; ``False`` if it left already."""
        mutex = self._mutex
        if mutex is None:
            return False
        with mutex:
            if self._gone:
                return False
            self._turn = turn
        with contextlib.suppress(RuntimeError):  # a settle released it already
            self._lock.release()
        return True

    def wait(self, timeout: float, what: str) -> Any:
        """Sleep until the reply is settled (running the turns handed over meanwhile); raise
        it, or :class:`~kvactors.errors.DeadlineExceededError` past ``timeout`` seconds."""
        mutex = self._mutex
        if mutex is None:  # nothing of the caller queued: no turn can be handed over
            if not self._done and not self._lock.acquire(timeout=timeout):
                raise DeadlineExceededError(actor="runtime", message_type=what, timeout=timeout)
        else:
            self._wait_turns(mutex, timeout)
            if not self._done:
                raise DeadlineExceededError(actor="runtime", message_type=what, timeout=timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def _wait_turns(self, mutex: threading.Lock, timeout: float) -> None:
        end = time.monotonic() + timeout
        try:
            while True:
                leave = self._done or time.monotonic() >= end
                with mutex:
                    turn, self._turn = self._turn, None
                    if turn is None and leave:
                        self._gone = True
                        return
                if turn is not None:
                    turn()
                else:
                    self._lock.acquire(timeout=max(0.0, end - time.monotonic()))
        finally:
            # Left by an exception (a turn's BaseException): refuse later hand-offs, and run
            # one handed over meanwhile, so that no actor waits for a caller that is gone.
            with mutex:
                self._gone = True
                turn, self._turn = self._turn, None
            if turn is not None:
                turn()


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
