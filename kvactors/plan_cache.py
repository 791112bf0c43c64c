"""Validated plans, reused while their operands have not changed (pure, thread-safe).

Theory of operation. :func:`~kvactors.plans.plan_transfer` reads metadata only, so its answer
is a function of the request and of every operand's metadata: its storage (base address and
offset), data pointer, shape, stride, dtype and device, plus the operand structure (a list of
layers, ``[[K...], [V...]]``, one tensor). :class:`PlanCache` keys a validated plan by the
encoded request, the operand structure and every tensor's data pointer (cheap to hash), and
keeps with it the rest of every tensor's metadata (storage offset, shape, stride, dtype,
device: compared, never hashed) and its version counter (``t._version``, bumped by every
in-place write, ``set_``, ``resize_`` and in-place view op such as ``transpose_``). A lookup
recomputes all of it from the operands it is given and reuses the plan only when every fact
is equal, so a stale plan cannot be used: any change of any of those facts re-validates. All
of one tensor's facts are read in one pass (its metadata is touched once per call). Failed
validations are never cached (every bad call raises afresh).

The version counters also move when kvactors itself writes an operand (a gather writes the
chunks, a scatter the paged memory). After a transfer ran, :meth:`PlanCache.settle` re-reads
the versions of the side the transfer wrote and stores them with the entry, so the next
identical call hits (the other side keeps the versions the lookup saw: a write by anybody else
meanwhile re-validates). Only versions are re-read: the rest of the facts is what was
validated, so the entry can only ever match operands whose metadata is exactly the validated
metadata.

The cache is bounded (least recently used entries go first) and takes a lock only around the
dictionary, never around validation.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.errors import InvalidSettingError
from kvactors.layouts import Direction
from kvactors.plans import TransferRequest, plan_transfer

if TYPE_CHECKING:
    from kvactors.plans import TransferPlan

__all__ = ("PlanCache", "PlanTicket")

_Tensor = torch.Tensor
_encode = msgspec.msgpack.Encoder().encode


class _Entry:
    __slots__ = ("facts", "memo", "plan")

    def __init__(self, plan: TransferPlan, facts: list[tuple[Any, ...]]) -> None:
        self.plan = plan
        self.facts = facts  # per tensor: _facts' row, the version counter last
        self.memo: dict[Any, Any] = {}


class PlanTicket:
    """What a lookup saw (held for one call only): its key, the operand tensors and their
    facts, so that :meth:`PlanCache.settle` can re-read the version counters of the side the
    transfer wrote, and the plan's kernel memo (index tensors and view geometry kept with the
    plan, see ``run_fast``)."""

    __slots__ = ("entry", "facts", "key", "memo", "paged", "tensors")

    def __init__(
        self,
        key: tuple[Any, ...],
        tensors: list[torch.Tensor],
        facts: list[tuple[Any, ...]],
        paged: int,
    ) -> None:
        self.key = key
        self.tensors = tensors
        self.facts = facts
        self.paged = paged  # the first ``paged`` tensors are the paged ones
        self.entry: _Entry | None = None
        self.memo: dict[Any, Any] = {}


_T = "t"  # a tensor's place in the structure


def _flatten(value: object, depth: int, structure: list[Any], tensors: list[torch.Tensor]) -> bool:
    """Append ``value``'s structure (list/tuple markers and lengths, ``_T`` per tensor) and
    its tensors in order; ``False`` for anything but a tensor or a nested (at most 3 deep)
    list or tuple of tensors."""
    if isinstance(value, _Tensor):
        structure.append(_T)
        tensors.append(value)
        return True
    if depth >= 3 or not isinstance(value, (list, tuple)):
        return False
    structure.append("[" if isinstance(value, list) else "(")
    structure.append(len(value))
    for v in value:  # one frame per list, not per tensor
        if isinstance(v, _Tensor):
            structure.append(_T)
            tensors.append(v)
        elif not _flatten(v, depth + 1, structure, tensors):
            return False
    return True


def _facts(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Per tensor, in ONE pass (each tensor's metadata is read while it is in cache): data
    pointer, storage offset, shape, stride, dtype, device and, last, the version counter."""
    return [
        (t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, t._version)
        for t in tensors
    ]


class PlanCache:
    """Validated plans by (request, operand fingerprint); see the module docstring.

    Args:
        device_type: The device type the runtime serves (passed to ``plan_transfer``).
        device_index: Its index.
        capacity: Most plans kept (least recently used go first).
    """

    def __init__(self, device_type: str, device_index: int | None, capacity: int = 256) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"plan cache capacity must be positive, got {capacity}", setting="capacity"
            )
        self.device_type = device_type
        self.device_index = device_index
        self.capacity = capacity
        self._plans: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, request: TransferRequest, paged: object, objects: object) -> TransferPlan:
        """The plan for this request and these operands (see :meth:`lookup`)."""
        return self.lookup(request, paged, objects)[0]

    def lookup(
        self, request: TransferRequest, paged: object, objects: object
    ) -> tuple[TransferPlan, PlanTicket | None]:
        """The plan for this request and these operands: reused if validated before for
        identical operands, else validated now (raising exactly as ``plan_transfer``), and
        the ticket to :meth:`settle` once the transfer ran."""
        ticket = self._ticket(request, paged, objects)
        if ticket is not None:
            with self._lock:
                entry = self._plans.get(ticket.key)
                if entry is not None and entry.facts == ticket.facts:
                    self._plans.move_to_end(ticket.key)
                    self.hits += 1
                    ticket.entry, ticket.memo = entry, entry.memo
                    return entry.plan, ticket
        plan = plan_transfer(
            request,
            paged,
            objects,
            device_type=self.device_type,
            device_index=self.device_index,
        )
        with self._lock:
            self.misses += 1
            if ticket is not None:
                entry = _Entry(plan, ticket.facts)
                ticket.entry, ticket.memo = entry, entry.memo
                self._plans[ticket.key] = entry
                self._plans.move_to_end(ticket.key)
                while len(self._plans) > self.capacity:
                    self._plans.popitem(last=False)
        return plan, ticket

    def settle(self, plan: TransferPlan, ticket: PlanTicket | None) -> None:
        """After ``plan`` ran: keep the operands' current version counters with its entry.

        Only the versions are re-read: every other fact in the key is the validated one, so
        the entry can only ever match operands whose metadata equals what was validated."""
        if ticket is None or ticket.entry is None:
            return
        # Only the side the transfer wrote is re-read (a gather writes the chunks, a scatter
        # the paged memory); the other keeps the versions the lookup saw, so a write by
        # anybody else meanwhile still re-validates the next call.
        n, seen, ts = ticket.paged, ticket.facts, ticket.tensors
        if plan.direction == Direction.D2H:
            lo, hi = n, len(ts)
        else:
            lo, hi = 0, n
        rows = list(seen)
        for i in range(lo, hi):
            rows[i] = (*seen[i][:-1], ts[i]._version)
        ticket.entry.facts = rows

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()

    def _ticket(
        self, request: TransferRequest, paged: object, objects: object
    ) -> PlanTicket | None:
        if type(request) is not TransferRequest:
            return None
        structure: list[Any] = []
        tensors: list[torch.Tensor] = []
        if not _flatten(paged, 0, structure, tensors):
            return None
        n_paged = len(tensors)
        if not _flatten(objects, 1, structure, tensors):
            return None
        try:
            # The encoded request, not the Struct: ``True == 1`` and ``1.0 == 1`` compare equal,
            # but a bool or float field must fail validation, never hit a cached int's plan.
            wire = _encode(request)
        except (TypeError, ValueError, OverflowError):  # not wire-safe: validate every time
            return None
        # The key hashes only cheap facts (bytes, markers, data pointers); the rest of the
        # metadata is compared with the entry's, so tensors' sizes, dtypes and devices are
        # never hashed on the hot path.
        facts = _facts(tensors)
        structure.append(wire)
        structure += [f[0] for f in facts]
        return PlanTicket(tuple(structure), tensors, facts, n_paged)
