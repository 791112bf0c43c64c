"""Pure ordering core: block fences and publication order (no asyncio, no devices).

:class:`BlockLedger` (fence before reuse): a fence snapshots the transfers in flight on its
blocks and is released when the last of them finishes; later transfers never delay it.
:class:`PublishOrder`: records are published in any order but drained only as the longest
published prefix, so readers see submission order; a failed record is withdrawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from kvactors.errors import ProtocolError

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ("BlockLedger", "PublishOrder")

R = TypeVar("R")


class BlockLedger:
    """In-flight transfers per engine block, and the fences waiting on them.

    Transfers are the hot path and fences the rare one, so a transfer costs one dictionary
    entry each way (its block set, kept as given when it is a frozenset) and a fence scans the
    transfers in flight for the ones touching its blocks."""

    def __init__(self) -> None:
        self._blocks_of: dict[int, frozenset[int]] = {}
        self._readers: set[int] = set()  # transfers begun apart that only read their blocks
        self._fence_waits: dict[int, set[int]] = {}
        self._fences_on: dict[int, set[int]] = {}

    @property
    def inflight(self) -> int:
        """Number of transfers begun and not finished."""
        return len(self._blocks_of)

    @property
    def fences(self) -> int:
        """Number of fences still waiting."""
        return len(self._fence_waits)

    def __contains__(self, transfer_id: object) -> bool:
        """Whether ``transfer_id`` was begun and not finished."""
        return transfer_id in self._blocks_of

    def begin(self, transfer_id: int, blocks: Iterable[int]) -> None:
        """Record that ``transfer_id`` is in flight on ``blocks``."""
        if transfer_id in self._blocks_of:
            raise ProtocolError(
                f"transfer {transfer_id} begun twice", actor="BlockLedger", state="inflight"
            )
        self._blocks_of[transfer_id] = blocks if type(blocks) is frozenset else frozenset(blocks)

    def begin_apart(self, transfer_id: int, blocks: frozenset[int], *, reads: bool) -> bool:
        """Begin ``transfer_id`` on ``blocks`` only if its copy may run beside every transfer
        in flight: none shares a block, or both only read the blocks (``reads``: a gather;
        a transfer begun with :meth:`begin` counts as writing them). ``False``, nothing
        recorded, otherwise."""
        if transfer_id in self._blocks_of:
            raise ProtocolError(
                f"transfer {transfer_id} begun twice", actor="BlockLedger", state="inflight"
            )
        readers = self._readers
        for t, bs in self._blocks_of.items():
            if not blocks.isdisjoint(bs) and not (reads and t in readers):
                return False
        self._blocks_of[transfer_id] = blocks
        if reads:
            readers.add(transfer_id)
        return True

    def finish(self, transfer_id: int) -> list[int]:
        """Record completion (or failure) of ``transfer_id``; return the fences it released."""
        if self._blocks_of.pop(transfer_id, None) is None:
            raise ProtocolError(
                f"transfer {transfer_id} finished but never begun",
                actor="BlockLedger",
                state="idle",
            )
        self._readers.discard(transfer_id)
        fences = self._fences_on.pop(transfer_id, None)
        if not fences:
            return []
        released: list[int] = []
        for fence_id in sorted(fences):
            waits = self._fence_waits[fence_id]
            waits.discard(transfer_id)
            if not waits:
                del self._fence_waits[fence_id]
                released.append(fence_id)
        return released

    def fence(self, fence_id: int, blocks: Iterable[int]) -> int:
        """Take a fence on ``blocks``; return how many transfers it waits for (0: ready now)."""
        if fence_id in self._fence_waits:
            raise ProtocolError(
                f"fence {fence_id} taken twice", actor="BlockLedger", state="fencing"
            )
        wanted = frozenset(blocks)
        waits = {t for t, bs in self._blocks_of.items() if not wanted.isdisjoint(bs)}
        if waits:
            self._fence_waits[fence_id] = waits
            for t in waits:
                self._fences_on.setdefault(t, set()).add(fence_id)
        return len(waits)


class PublishOrder(Generic[R]):
    """Records published in any order, drained in submission order (published prefix only)."""

    def __init__(self) -> None:
        self._next = 0
        self._head = 0
        self._slots: dict[int, tuple[bool, R | None]] = {}

    @property
    def pending(self) -> int:
        """Submitted records not drained yet (published or not)."""
        return len(self._slots)

    def submit(self) -> int:
        """Reserve the next sequence number."""
        seq = self._next
        self._next += 1
        self._slots[seq] = (False, None)
        return seq

    def publish(self, seq: int, record: R) -> None:
        """Make record ``seq`` drainable (once every earlier record is too)."""
        slot = self._slots.get(seq)
        if slot is None or slot[0]:
            raise ProtocolError(
                f"record {seq} published twice or never submitted",
                actor="PublishOrder",
                state="publish",
            )
        self._slots[seq] = (True, record)

    def withdraw(self, seq: int) -> None:
        """Drop record ``seq`` (its stream failed) so it does not hold back later records."""
        self._slots.pop(seq, None)
        self._advance_over_gaps()

    def drain(self) -> list[R]:
        """Return and forget the published prefix, in submission order."""
        out: list[R] = []
        while self._head < self._next:
            slot = self._slots.get(self._head)
            if slot is None:
                self._head += 1
                continue
            done, record = slot
            if not done:
                break
            del self._slots[self._head]
            out.append(record)  # type: ignore[arg-type]
            self._head += 1
        return out

    def _advance_over_gaps(self) -> None:
        while self._head < self._next and self._head not in self._slots:
            self._head += 1
