"""The directory of a device's StreamActors, one per stream handle, made on first use and
retired when idle.

Handle 0 (the default stream) lives as long as the runtime. A borrowed caller stream gets an
actor on its first message; once idle it joins an LRU list and is retired (``close_if_idle``,
atomic with sends) when more than ``max_idle`` are idle or ``idle_seconds`` passed. An actor
is idle once its mailbox and turns hold nothing, even while its lane still watches work it
launched (a plain call's copy): that work is on the device stream already, behind which a
new actor's work on the same handle queues. A retired actor stops only once its lane dropped
every lease (:meth:`StreamActor.retire`), and until then :meth:`StreamDirectory.retiring`
lists it, so that an IPC close waits for it too (rule 2). Retiring changes no order; a later
message makes a new actor (:meth:`StreamDirectory.send`, the one place a message an actor
retired meanwhile refused goes on to its handle's new actor).
:meth:`StreamDirectory.on_retire` listeners hear each retired handle.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from typing import TYPE_CHECKING, Any

from kvactors.actors.stream import StreamActor
from kvactors.errors import ActorClosedError

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.actors.outbox import Outbox
    from kvactors.actors.reply import Reply
    from kvactors.core.protocols.stream import EventRecord, StreamRequest
    from kvactors.devices.base import Backend

__all__ = ("StreamDirectory",)


class StreamDirectory:
    """Maps stream handles to StreamActors. Handle 0 is the device's default stream; a
    nonzero handle borrows the caller's stream, which kvactors never destroys."""

    def __init__(
        self,
        *,
        backend: Backend,
        index: int,
        completions: Outbox[tuple[str, bytes]],
        events: Outbox[EventRecord],
        capacity: int,
        stop_timeout: float,
        max_idle: int = 8,
        idle_seconds: float = 30.0,
    ) -> None:
        self.backend = backend
        self.index = index
        self.completions = completions
        self.events = events
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self._capacity = capacity
        self._stop_timeout = stop_timeout
        self._actors: dict[int, StreamActor] = {}
        #: The StreamActor of a handle if one runs, else None (any thread; never creates
        #: one): the dict's own ``get``, so a plain call's lookup costs no Python frame.
        self.peek: Callable[[int], StreamActor | None] = self._actors.get
        self._idle: collections.OrderedDict[int, asyncio.TimerHandle | None] = (
            collections.OrderedDict()
        )
        # Retired actors whose stop has not ended, by their stop task.
        self._retiring: dict[asyncio.Task[None], StreamActor] = {}
        self._listeners: list[Callable[[int], None]] = []
        self._retired: weakref.WeakSet[StreamActor] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.retired = 0
        #: Lanes of retired actors whose threads did not end within the stop timeout.
        self.retired_lanes_abandoned = 0

    def get(self, handle: int) -> StreamActor:
        """The StreamActor for ``handle``, started on first use (any thread; the first call
        is made on the event loop)."""
        actor = self._actors.get(handle)
        if actor is not None:
            return actor
        with self._lock:
            actor = self._actors.get(handle)
            if actor is not None:
                return actor
            if self._closed:
                raise ActorClosedError("streams are closed", actor=self._name(handle))
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            stream = self.backend.stream_from_handle(handle, self.index)
            actor = StreamActor(
                self._name(handle),
                backend=self.backend,
                index=self.index,
                stream=stream,
                completions=self.completions,
                events=self.events,
                capacity=self._capacity,
                stop_timeout=self._stop_timeout,
            )
            actor.start(loop)
            if handle != 0:
                actor.on_idle = lambda: self._went_idle(handle)
            self._actors[handle] = actor
            return actor

    def send(
        self,
        handle: int,
        msg: StreamRequest,
        operands: Any = None,
        *,
        reply: Reply[Any] | None = None,
        actor: StreamActor | None = None,
    ) -> StreamActor:
        """Send ``msg`` to ``handle``'s StreamActor (``actor`` if the caller looked it up
        already): an ask with ``reply``, else a tell. An idle actor the directory retired
        between the lookup and the send refused it (nothing ran, no order changed): the
        handle's new actor takes it. Returns the actor that took it; raises what the send
        raises (:class:`~kvactors.errors.MailboxFullError` included)."""
        if actor is None:
            actor = self.get(handle)
        try:
            _send(actor, msg, operands, reply)
        except ActorClosedError:
            with self._lock:  # retirement closes and forgets an actor under this lock
                if actor not in self._retired:
                    raise
            actor = self.get(handle)
            _send(actor, msg, operands, reply)
        return actor

    def all(self) -> list[StreamActor]:
        """Every StreamActor running now."""
        return list(self._actors.values())

    def retiring(self) -> list[tuple[StreamActor, asyncio.Task[None]]]:
        """Retired StreamActors whose stop has not ended (on the loop), each with its stop
        task: work they launched may still run on their stream until the task ended."""
        return [(actor, task) for task, actor in self._retiring.items() if not task.done()]

    def on_retire(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(handle)`` on the loop whenever an idle actor is retired."""
        self._listeners.append(listener)

    async def stop(self, *, timeout: float | None) -> None:
        """Stop every StreamActor (graceful, bounded), retiring ones included."""
        with self._lock:
            self._closed = True
        for timer in self._idle.values():
            if timer is not None:
                timer.cancel()
        self._idle.clear()
        failures: list[BaseException] = []
        for actor in list(self._actors.values()):
            try:  # one actor's failed stop must not leave the others running
                await actor.stop(graceful=True, timeout=timeout)
            except Exception as exc:
                failures.append(exc)
        if self._retiring:
            _, late = await asyncio.wait(set(self._retiring), timeout=timeout)
            for task in late:  # still waiting for its device: its lane threads live on
                self._retiring.pop(task, None)
                self.retired_lanes_abandoned += 1
        if failures:
            raise failures[0]

    # ---- retirement (on the loop) ------------------------------------------------------

    def _went_idle(self, handle: int) -> None:
        actor = self._actors.get(handle)
        if self._closed or handle in self._idle or actor is None:
            return
        actor.idle_noted = True
        loop = asyncio.get_running_loop()
        self._idle[handle] = loop.call_later(self.idle_seconds, self._retire, handle)
        while len(self._idle) > self.max_idle:
            oldest = next(iter(self._idle))
            self._retire(oldest)

    def _retire(self, handle: int) -> None:
        timer = self._idle.pop(handle, None)
        if timer is not None:
            timer.cancel()
        actor = self._actors.get(handle)
        if actor is None or self._closed:
            return
        actor.idle_noted = False
        with self._lock:
            if not actor.close_if_idle():  # used again meanwhile: keep it
                return
            del self._actors[handle]
            self._retired.add(actor)
        self.retired += 1
        task = asyncio.get_running_loop().create_task(
            actor.retire(self._stop_timeout), name=f"retire:{actor.name}"
        )
        self._retiring[task] = actor
        task.add_done_callback(self._retired_stop)
        for listener in self._listeners:
            listener(handle)

    def _retired_stop(self, task: asyncio.Task[None]) -> None:
        # A retired actor leaves all(): keep its abandoned lanes counted (Runtime.close raises);
        # one that stop() already counted as abandoned is not counted again.
        actor = self._retiring.pop(task, None)
        if actor is not None:
            self.retired_lanes_abandoned += actor.lanes_abandoned

    def _name(self, handle: int) -> str:
        return f"stream:{self.backend.kind}:{self.index}:{handle:#x}"


def _send(actor: StreamActor, msg: StreamRequest, operands: Any, reply: Reply[Any] | None) -> None:
    if reply is None:
        actor.tell_nowait(msg, operands)
    else:
        actor.ask_nowait(msg, operands, reply=reply)
