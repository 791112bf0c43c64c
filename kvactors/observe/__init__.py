"""Observe a :class:`~kvactors.runtime.Runtime`'s calls (tracing, metrics) through its hook.

``Runtime(observer=...)`` or :meth:`Runtime.add_observer <kvactors.runtime.Runtime.add_observer>`
attach a :class:`RuntimeObserver`: ``call_started`` at mailbox admission, ``call_finished``
when the reply settles, each with a :class:`Call` carrying the runtime's own message (see
:mod:`kvactors.runtime.observer`). :func:`observe` is the attach function under its documented name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors.runtime.observer import Call, CallOp, RuntimeObserver

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.runtime import Runtime

__all__ = ("Call", "CallOp", "RuntimeObserver", "observe")


def observe(rt: Runtime, observer: RuntimeObserver) -> Callable[[], None]:
    """Report every call of ``rt`` to ``observer``; returns a function that detaches it."""
    return rt.add_observer(observer)
