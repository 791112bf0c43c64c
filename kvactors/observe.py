"""Observe a :class:`~kvactors.runtime.Runtime`'s calls from the outside (tracing, metrics).

Theory of operation. The runtime's actors belong to the runtime; an observer must not change
them. :func:`observe` therefore wraps the public facade of one runtime *instance* (instance
attributes shadow the class's methods): ``transfer``/``atransfer``, ``fence``/``afence``,
``synchronize`` and ``ping``/``aping``. Each call gets a sequence number and the wire message
it corresponds to (:class:`~kvactors.protocols.gather.Transfer`, ``Fence``, ``Ping``,
:class:`~kvactors.protocols.stream.Sync`); observers hear ``call_started`` before the call
reaches the runtime and ``call_finished`` after it returned or raised, on the caller's thread.

The message an observer sees is built outside the runtime, so its ``transfer_id`` is the
observer's sequence number, not the runtime's own id. ``started`` order is the order callers
entered the facade: with several threads this can differ from mailbox order by a race (a hook
inside the runtime, at mailbox admission, would remove that; see ``docs/architecture.md``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvactors.protocols.gather import Fence, Ping, Transfer
from kvactors.protocols.stream import Sync

if TYPE_CHECKING:
    from collections.abc import Callable

    import msgspec

    from kvactors.runtime import Runtime

__all__ = ("Call", "RuntimeObserver", "observe")


class Call:
    """One observed call: sequence number, operation, wire message, operands, start time."""

    __slots__ = ("message", "objects", "op", "paged", "seq", "started", "stream_handle")

    def __init__(
        self,
        seq: int,
        op: str,
        message: msgspec.Struct,
        *,
        paged: Any = None,
        objects: Any = None,
        stream_handle: int = 0,
    ) -> None:
        self.seq = seq
        self.op = op
        self.message = message
        self.paged = paged
        self.objects = objects
        self.stream_handle = stream_handle
        self.started = time.perf_counter()


class RuntimeObserver(Protocol):
    """What :func:`observe` calls; both methods run on the calling thread and must be quick."""

    def call_started(self, call: Call) -> None:
        """``call`` is about to enter the runtime."""
        ...

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        """``call`` returned ``result`` or raised ``error`` after ``seconds``."""
        ...


class _Hub:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.observers: list[RuntimeObserver] = []
        self.lock = threading.Lock()
        self.seq = itertools.count(1)

    def started(self, call: Call) -> None:
        for o in list(self.observers):
            o.call_started(call)

    def finished(self, call: Call, result: Any, error: BaseException | None) -> None:
        seconds = time.perf_counter() - call.started
        for o in list(self.observers):
            o.call_finished(call, seconds, result, error)


_HUB_ATTR = "_kvactors_observe_hub"
_WRAPPED = ("transfer", "atransfer", "fence", "afence", "synchronize", "ping", "aping")


def _make_call(hub: _Hub, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Call:
    seq = next(hub.seq)
    if name in ("transfer", "atransfer"):
        vals = dict(zip(("request", "paged", "objects"), args, strict=False))
        vals.update({k: kw[k] for k in ("request", "paged", "objects") if k in kw})
        request, paged, objects = vals["request"], vals.get("paged"), vals.get("objects")
        handle = int(kw.get("stream_handle", 0))
        msg = Transfer(transfer_id=seq, request=request, stream_handle=handle)
        return Call(seq, "transfer", msg, paged=paged, objects=objects, stream_handle=handle)
    if name in ("fence", "afence"):
        ids = args[0] if args else kw["block_ids"]
        return Call(seq, "fence", Fence(block_ids=tuple(int(b) for b in ids)))
    if name == "synchronize":
        handle = int(args[0] if args else kw.get("stream_handle", 0))
        return Call(seq, "synchronize", Sync(), stream_handle=handle)
    return Call(seq, "ping", Ping(seq=int(args[0] if args else kw.get("seq", 0))))


def _wrap(hub: _Hub, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    if name.startswith("a"):

        @functools.wraps(method)
        def awrapper(*args: Any, **kw: Any) -> Any:
            # The a* methods submit at call time and return a future; so does the wrapper,
            # keeping call order equal to mailbox order.
            call = _make_call(hub, name, args, kw)
            hub.started(call)
            try:
                fut = method(*args, **kw)
            except BaseException as exc:
                hub.finished(call, None, exc)
                raise

            def done(f: Any) -> None:
                if f.cancelled():
                    hub.finished(call, None, asyncio.CancelledError())
                elif (exc := f.exception()) is not None:
                    hub.finished(call, None, exc)
                else:
                    hub.finished(call, f.result(), None)

            fut.add_done_callback(done)
            return fut

        return awrapper

    @functools.wraps(method)
    def wrapper(*args: Any, **kw: Any) -> Any:
        call = _make_call(hub, name, args, kw)
        hub.started(call)
        try:
            result = method(*args, **kw)
        except BaseException as exc:
            hub.finished(call, None, exc)
            raise
        hub.finished(call, result, None)
        return result

    return wrapper


def observe(rt: Runtime, observer: RuntimeObserver) -> Callable[[], None]:
    """Report every facade call of ``rt`` to ``observer``; returns a function that detaches it.

    Several observers can watch one runtime; the facade is unwrapped when the last detaches.
    """
    hub: _Hub | None = getattr(rt, _HUB_ATTR, None)
    if hub is None:
        hub = _Hub(rt)
        for name in _WRAPPED:
            setattr(rt, name, _wrap(hub, name, getattr(rt, name)))
        setattr(rt, _HUB_ATTR, hub)
    with hub.lock:
        hub.observers.append(observer)

    def detach() -> None:
        assert hub is not None
        with hub.lock:
            if observer in hub.observers:
                hub.observers.remove(observer)
            empty = not hub.observers
        if empty and getattr(rt, _HUB_ATTR, None) is hub:
            for name in _WRAPPED:
                rt.__dict__.pop(name, None)
            delattr(rt, _HUB_ATTR)

    return detach
