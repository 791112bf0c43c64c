"""StreamActor protocol: work and records ordered on one device stream."""

from __future__ import annotations

from typing import TypeAlias

from kvactors.core.protocols._base import Message

__all__ = (
    "EventRecord",
    "Launch",
    "Launched",
    "RecordCompletion",
    "RecordEvent",
    "StreamReply",
    "StreamRequest",
    "Sync",
    "Synced",
)


class Launch(Message, frozen=True):
    """Run one piece of device work (its callable rides in the operand bundle).

    Replied to with :class:`Launched` only after the device finished the work; the actor
    owns the operands until then.
    """

    transfer_id: int
    nbytes: int = 0


class RecordCompletion(Message, frozen=True):
    """Publish ``(kind, payload)`` once every earlier piece of work on the stream ran."""

    kind: str
    payload: bytes


class EventRecord(Message, frozen=True):
    """One event record as LMCache drains it (type, session, wall time, string and int fields)."""

    event_type: str
    session_id: str
    wall_ts: float
    str_fields: dict[str, str]
    int_fields: dict[str, int]


class RecordEvent(Message, frozen=True):
    """Publish an event record once every earlier piece of work on the stream ran."""

    record: EventRecord


class Sync(Message, frozen=True):
    """Barrier: replied to with :class:`Synced` once every earlier piece of work ran."""


class Launched(Message, frozen=True):
    """Reply to :class:`Launch`: the work completed on the device."""

    transfer_id: int
    nbytes: int


class Synced(Message, frozen=True):
    """Reply to :class:`Sync`: ``completed`` pieces of work had finished at the barrier."""

    completed: int


StreamRequest: TypeAlias = Launch | RecordCompletion | RecordEvent | Sync
StreamReply: TypeAlias = Launched | Synced
