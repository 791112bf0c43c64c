"""The completion outbox: records published by lanes, drained by any thread in order."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kvactors.core.ordering import PublishOrder

__all__ = ("Outbox",)

R = TypeVar("R")


class Outbox(Generic[R]):
    """A thread-safe :class:`~kvactors.core.ordering.PublishOrder`.

    Sequence numbers are reserved on the event loop in mailbox order; lane threads publish
    after their stream synchronized; LMCache's threads drain the published prefix.

    Every reserved slot is settled exactly once: published, or withdrawn (its stream failed,
    or the runtime closed before the stream ran that far; ``withdrawn`` counts those). The
    first settle wins, so a lane thread abandoned at close that reaches its publish after the
    slot was withdrawn publishes nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order: PublishOrder[R] = PublishOrder()
        self._open: set[int] = set()
        self.published = 0
        self.withdrawn = 0

    def reserve(self) -> int:
        """Reserve the next slot (submission order)."""
        with self._lock:
            seq = self._order.submit()
            self._open.add(seq)
            return seq

    def publish(self, seq: int, record: R) -> bool:
        """Make slot ``seq`` drainable; ``False`` if it was already settled (nothing done)."""
        with self._lock:
            if seq not in self._open:
                return False
            self._open.discard(seq)
            self._order.publish(seq, record)
            self.published += 1
            return True

    def withdraw(self, seq: int) -> bool:
        """Give up slot ``seq``; ``False`` if it was already settled (nothing done)."""
        with self._lock:
            if seq not in self._open:
                return False
            self._open.discard(seq)
            self._order.withdraw(seq)
            self.withdrawn += 1
            return True

    def drain(self) -> list[R]:
        """Return and forget the published prefix, in submission order."""
        with self._lock:
            return self._order.drain()

    @property
    def pending(self) -> int:
        """Reserved slots not drained yet."""
        with self._lock:
            return self._order.pending
