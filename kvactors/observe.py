"""Observe a :class:`~kvactors.runtime.Runtime`'s calls (tracing, metrics) through its hook.

Theory of operation. The runtime reports its own calls: ``Runtime(observer=...)`` or
:meth:`Runtime.add_observer <kvactors.runtime.Runtime.add_observer>` attach a
:class:`RuntimeObserver`, and the runtime calls ``call_started`` at mailbox admission (on its
loop thread, so :attr:`Call.seq` is the order the actors handle messages in) and
``call_finished`` when the reply is settled. A :class:`Call` carries the runtime's own message,
``transfer_id`` included; nothing outside the runtime builds or guesses it, and no method of
the runtime is wrapped or replaced (see :mod:`kvactors._observer`).

:func:`observe` is the attach function under its documented name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors._observer import Call, CallOp, RuntimeObserver

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.runtime import Runtime

__all__ = ("Call", "CallOp", "RuntimeObserver", "observe")


def observe(rt: Runtime, observer: RuntimeObserver) -> Callable[[], None]:
    """Report every call of ``rt`` to ``observer``; returns a function that detaches it."""
    return rt.add_observer(observer)
