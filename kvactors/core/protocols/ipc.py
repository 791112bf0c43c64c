"""IPCOwnerActor protocol: opened IPC owners, closed only after a stream-sync barrier."""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvactors.core.protocols._base import Message

__all__ = (
    "CloseContext",
    "ContextClosed",
    "IPCHandle",
    "IPCReply",
    "IPCRequest",
    "OpenHandle",
    "Opened",
)


class IPCHandle(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A wire-safe description of exported device or shared memory; never a raw pointer."""

    backend: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    nbytes: int = 0
    device_index: int = 0
    extra: dict[str, str] = msgspec.field(default_factory=dict)


class OpenHandle(Message, frozen=True):
    """Open ``handle`` and keep its owner in context ``context_id``."""

    context_id: int
    handle: IPCHandle


class CloseContext(Message, frozen=True):
    """Close a context: stream sync, drop views, close every owner (always), forget.

    Before any owner is released, every stream the device's runtime knows is synchronized,
    plus the streams named in ``stream_handles`` (name a caller stream that used the views
    but never went through kvactors). Closing an unknown or already closed context is a
    no-op; a close sent while another close of the same context is in flight waits for it
    and gets the same answer.
    """

    context_id: int
    stream_handles: tuple[int, ...] = (0,)


class Opened(Message, frozen=True):
    """Reply to :class:`OpenHandle` (the view rides beside it in-process)."""

    context_id: int


class ContextClosed(Message, frozen=True):
    """Reply to :class:`CloseContext`: how many owners the close closed (0: nothing was open).

    Sent only after those owners are closed; a close that waited for one in flight reports
    that close's count."""

    context_id: int
    owners_closed: int


IPCRequest: TypeAlias = OpenHandle | CloseContext
IPCReply: TypeAlias = Opened | ContextClosed
