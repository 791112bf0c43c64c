"""What an actor's mailbox holds: the envelope of one message, and the names a ``receive``
uses (its :data:`DEFERRED` return, :func:`unreachable` for an exhaustive ``match``)."""

from __future__ import annotations

import asyncio
from typing import Any, Final, Generic, NoReturn, TypeVar, final

import msgspec

from kvactors.actors.reply import Reply

__all__ = ("DEFERRED", "Envelope", "unreachable")

M = TypeVar("M")

DEFERRED: Final = object()
"""Returned by ``receive`` when the actor settles the reply itself later."""


def unreachable(msg: NoReturn) -> NoReturn:
    """The ``case _`` of an exhaustive ``match`` on a protocol union: a message type added to
    the union but not handled fails the type check here, and at run time raises."""
    raise AssertionError(f"unhandled message {type(msg).__name__}")


@final
class Envelope(msgspec.Struct, Generic[M], eq=False):
    """A message, the operands riding beside it, and the reply of an ask (None for a tell).

    Mutable, compared and hashed by identity (a set of deferred envelopes holds it), and
    made in C: one per message."""

    msg: M
    operands: Any
    reply: Reply[Any] | None
    _timer: asyncio.TimerHandle | None = None

    def settle(self, exc: BaseException | None, value: Any = None) -> None:
        """Settle the reply with ``exc``, else ``value`` (a no-op for tells and settled asks)."""
        if self.reply is not None:
            self.reply.settle(exc, value)
        if self._timer is not None:
            timer, self._timer = self._timer, None
            timer.cancel()
