"""GatherActor protocol: validated gathers/scatters, fences and liveness pings."""

from __future__ import annotations

from typing import TypeAlias

from kvactors.core.plans import TransferRequest
from kvactors.core.protocols._base import Message

__all__ = (
    "Fence",
    "Fenced",
    "GatherReply",
    "GatherRequest",
    "Ping",
    "Pong",
    "Transfer",
    "TransferDone",
)


class Transfer(Message, frozen=True):
    """Gather (D2H, store) or scatter (H2D, retrieve) per ``request``.

    The paged tensors and host chunks ride in the operand bundle. ``stream_handle`` 0 is the
    device's default stream; nonzero borrows the caller's stream. ``complete`` False answers
    once the copies are enqueued on the stream instead of once they completed (the operands
    stay owned and the blocks fenced until completion either way).
    """

    transfer_id: int
    request: TransferRequest
    stream_handle: int = 0
    complete: bool = True


class Fence(Message, frozen=True):
    """Reply only after every earlier transfer touching ``block_ids`` has completed."""

    block_ids: tuple[int, ...]


class Ping(Message, frozen=True):
    """Liveness probe answered in the GatherActor's turn, after every message before it (also
    the barrier ``close_ipc_context`` passes first)."""

    seq: int = 0


class TransferDone(Message, frozen=True):
    """Reply to :class:`Transfer`: the copy completed on the device."""

    transfer_id: int
    nbytes: int
    blocks: int


class Fenced(Message, frozen=True):
    """Reply to :class:`Fence`: ``waited_for`` transfers were still in flight at the fence."""

    block_ids: tuple[int, ...]
    waited_for: int


class Pong(Message, frozen=True):
    """Reply to :class:`Ping`."""

    seq: int


GatherRequest: TypeAlias = Transfer | Fence | Ping
GatherReply: TypeAlias = TransferDone | Fenced | Pong
