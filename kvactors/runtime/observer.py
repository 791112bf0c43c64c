"""The runtime's observer hook: calls reported from inside, at mailbox admission.

With observers attached each facade ask becomes a :class:`Call` carrying the runtime's own
message: ``call_started`` runs on the sending thread right before the mailbox offer,
``call_finished`` when the reply settles (also for refused calls). The route is the same with
or without observers. Observers must be quick and must not call back into the runtime; one
that raises is logged and skipped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Literal, Protocol

from kvactors.core.protocols.gather import Fence, Ping, Transfer
from kvactors.core.protocols.ipc import CloseContext, OpenHandle
from kvactors.core.protocols.stream import Sync

__all__ = ("Call", "CallOp", "Observers", "RuntimeObserver")

_log = logging.getLogger("kvactors.observe")

CallOp = Literal["transfer", "fence", "ping", "synchronize", "open_ipc", "close_ipc", "other"]
"""The facade operation a :class:`Call` stands for."""


def _op(msg: object) -> CallOp:
    match msg:
        case Transfer():
            return "transfer"
        case Fence():
            return "fence"
        case Ping():
            return "ping"
        case Sync():
            return "synchronize"
        case OpenHandle():
            return "open_ipc"
        case CloseContext():
            return "close_ipc"
        case _:
            return "other"


class Call:
    """One observed call: admission sequence, operation, the runtime's message, operands."""

    __slots__ = ("message", "objects", "op", "paged", "seq", "started", "stream_handle")

    def __init__(self, message: Any, operands: Any, stream_handle: int) -> None:
        self.seq = 0
        """Admission order among observed calls of this runtime (set at admission, from 1)."""
        self.op: CallOp = _op(message)
        self.message = message
        self.paged: Any = getattr(operands, "paged", None)
        self.objects: Any = getattr(operands, "objects", None)
        self.stream_handle = stream_handle
        self.started = 0.0
        """``time.perf_counter()`` at admission."""


class RuntimeObserver(Protocol):
    """What the runtime calls; both methods must be quick."""

    def call_started(self, call: Call) -> None:
        """``call`` is being offered to the actor's mailbox (on the sending thread)."""
        ...

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        """The reply was settled with ``result`` or ``error``, ``seconds`` after admission."""
        ...


class Observers:
    """The observers of one runtime (thread-safe attach/detach; notification never raises)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.active: tuple[RuntimeObserver, ...] = ()
        """Snapshot read without the lock on every call; replaced, never mutated."""

    def add(self, observer: RuntimeObserver) -> None:
        """Attach ``observer``."""
        with self._lock:
            self.active = (*self.active, observer)

    def remove(self, observer: RuntimeObserver) -> None:
        """Detach ``observer`` (no-op if it is not attached)."""
        with self._lock:
            self.active = tuple(o for o in self.active if o is not observer)

    def started(self, call: Call) -> None:
        """Stamp ``call`` at admission and tell every observer (on the sending thread)."""
        call.seq = next(self._seq)
        call.started = time.perf_counter()
        for o in self.active:
            try:
                o.call_started(call)
            except Exception:
                _log.exception("observer %r failed in call_started", o)

    def finished(self, call: Call, result: Any, error: BaseException | None) -> None:
        """Tell every observer that ``call`` was settled (only for calls that started)."""
        if not call.seq:
            return
        seconds = time.perf_counter() - call.started
        for o in self.active:
            try:
                o.call_finished(call, seconds, result, error)
            except Exception:
                _log.exception("observer %r failed in call_finished", o)
