"""The directory of a device's StreamActors, one per stream handle, made on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors.actors.stream import StreamActor
from kvactors.errors import ActorClosedError

if TYPE_CHECKING:
    from kvactors.actors.outbox import Outbox
    from kvactors.devices.base import Backend
    from kvactors.protocols.stream import EventRecord

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
    ) -> None:
        self.backend = backend
        self.index = index
        self.completions = completions
        self.events = events
        self._capacity = capacity
        self._stop_timeout = stop_timeout
        self._actors: dict[int, StreamActor] = {}
        self._closed = False

    def get(self, handle: int) -> StreamActor:
        """The StreamActor for ``handle``, started on first use (call on the event loop)."""
        actor = self._actors.get(handle)
        if actor is None:
            if self._closed:
                raise ActorClosedError("streams are closed", actor=self._name(handle))
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
            actor.start()
            self._actors[handle] = actor
        return actor

    def all(self) -> list[StreamActor]:
        """Every StreamActor made so far."""
        return list(self._actors.values())

    async def stop(self, *, timeout: float | None) -> None:
        """Stop every StreamActor (graceful, bounded)."""
        self._closed = True
        for actor in list(self._actors.values()):
            await actor.stop(graceful=True, timeout=timeout)

    def _name(self, handle: int) -> str:
        return f"stream:{self.backend.kind}:{self.index}:{handle:#x}"
