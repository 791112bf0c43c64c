"""The completion outbox: records published by lanes, drained by any thread in order."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kvactors.ordering import PublishOrder

__all__ = ("Outbox",)

R = TypeVar("R")


class Outbox(Generic[R]):
    """A thread-safe :class:`~kvactors.ordering.PublishOrder`.

    Sequence numbers are reserved on the event loop in mailbox order; lane threads publish
    after their stream synchronized; LMCache's threads drain the published prefix.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order: PublishOrder[R] = PublishOrder()

    def reserve(self) -> int:
        """Reserve the next slot (submission order)."""
        with self._lock:
            return self._order.submit()

    def publish(self, seq: int, record: R) -> None:
        """Make slot ``seq`` drainable."""
        with self._lock:
            self._order.publish(seq, record)

    def withdraw(self, seq: int) -> None:
        """Give up slot ``seq`` (its stream failed)."""
        with self._lock:
            self._order.withdraw(seq)

    def drain(self) -> list[R]:
        """Return and forget the published prefix, in submission order."""
        with self._lock:
            return self._order.drain()

    @property
    def pending(self) -> int:
        """Reserved slots not drained yet."""
        with self._lock:
            return self._order.pending
