"""Validated plans, reused while their operands' metadata has not changed (pure, thread-safe).

:class:`PlanCache` keys an entry by the request without its block ids plus every operand's
metadata except the chunks' addresses (one ``bytes`` key); a hit rebinds the validated plan to
the call's block ids and chunks (:func:`~kvactors.core.plans.rebind_block_ids` checks only the
ids), anything else validates in full. Failed validations are never cached; the cache is
bounded (oldest first) and a hit takes no lock.
"""

from __future__ import annotations

import collections
import operator
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import msgspec
import torch

from kvactors.core.plans import TransferRequest, plan_transfer, rebind_block_ids
from kvactors.errors import InvalidSettingError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.core.plans import TransferPlan

__all__ = ("Binder", "Kernel", "KernelMemo", "Lookup", "PlanCache")

Kernel: TypeAlias = "Callable[[Any, Sequence[torch.Tensor]], None]"
"""``kernel(paged, objects)``: one plan's copies on the operands it was planned for."""
Binder: TypeAlias = "Callable[[TransferPlan], Kernel]"
"""``binder(plan)``: the kernel of a plan of one cache entry."""


class KernelMemo:
    """What the kernels (:func:`kvactors.kernels.fast.reused_kernel`) keep with one cache
    entry: facts that depend on neither the block ids nor the chunks' addresses.

    Attributes:
        binder: Builds the kernel ``kernel(paged, objects)`` of a plan of the entry (the
            path and its views' geometry, decided on the entry's first run).
        last: The block ids of the latest kernel built, and that kernel.
    """

    __slots__ = ("binder", "last")

    def __init__(self) -> None:
        self.binder: Binder | None = None
        self.last: tuple[tuple[int, ...], Kernel] | None = None


_Tensor = torch.Tensor
_encode = msgspec.msgpack.Encoder().encode


class _Entry:
    """A plan validated in full for one key, the latest plan issued for it (with its encoded
    block ids and chunk pointers), and the kernels' memo."""

    __slots__ = ("last", "memo", "template")

    def __init__(self, plan: TransferPlan, ids: bytes) -> None:
        self.template = plan
        self.last: tuple[bytes, tuple[int, ...], TransferPlan] = (ids, plan.object_ptrs, plan)
        self.memo = KernelMemo()


class Lookup(NamedTuple):
    """What :meth:`PlanCache.lookup` found: the plan, and for a keyed request its kernels'
    memo and whether an operand is an inference tensor (the kernel then runs in inference
    mode)."""

    plan: TransferPlan
    memo: KernelMemo | None = None
    inference: bool = False


_T = "t"  # a tensor's place in the structure
_TS = "*"  # a sequence of nothing but tensors (its length is before it)
_TENSOR_TYPES: set[type] = {_Tensor}  # tensor classes seen in operand lists


class _Codes(dict[Any, int]):
    """dtype or device -> its code in keys; a value met first gets the next code (under a
    lock: two threads must never give two values one code). Codes are never reused."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __missing__(self, value: Any) -> int:
        with self._lock:
            return self.setdefault(value, len(self))


_CODES = _Codes()
_SEVENTH = operator.itemgetter(6)  # a paged tensor's fact: is it an inference tensor
_FIFTH = operator.itemgetter(4)  # the same fact of a chunk


def _flatten(value: object, depth: int, structure: list[Any], tensors: list[torch.Tensor]) -> bool:
    """Append ``value``'s structure (list/tuple markers and lengths, ``_T`` per tensor or
    ``_TS`` for a sequence of tensors only) and its tensors in order; ``False`` for anything
    but a tensor or a nested (at most 3 deep) list or tuple of tensors."""
    if isinstance(value, _Tensor):
        structure.append(_T)
        tensors.append(value)
        return True
    if depth >= 3 or not isinstance(value, (list, tuple)):
        return False
    structure.append("[" if isinstance(value, list) else "(")
    structure.append(len(value))
    kinds = set(map(type, value))  # per distinct element type: 64 layers are one check
    if kinds <= _TENSOR_TYPES or all(issubclass(k, _Tensor) for k in kinds):
        _TENSOR_TYPES.update(kinds)
        structure.append(_TS)
        tensors.extend(value)
        return True
    for v in value:
        if isinstance(v, _Tensor):
            structure.append(_T)
            tensors.append(v)
        elif not _flatten(v, depth + 1, structure, tensors):
            return False
    return True


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """A paged tensor's facts: data pointer, storage offset, shape, stride, dtype and device
    codes, whether it is an inference tensor."""
    return (
        t.data_ptr(),
        t.storage_offset(),
        t.shape,
        t.stride(),
        _CODES[t.dtype],
        _CODES[t.device],
        t.is_inference(),
    )


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """The first paged tensor's storage, identity and size: the one-storage decision of the
    plan (``plans._stacked``) and the views the kernels build over it depend on both."""
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def _chunks(chunks: Sequence[torch.Tensor]) -> tuple[list[tuple[Any, ...]], list[int]] | None:
    """The chunks' facts but their addresses (the plan is rebound to them), and their data
    pointers; ``None`` when a chunk does not lie inside its storage (validation refuses it;
    a storage may shrink under a chunk after its plan was made)."""
    meta: list[tuple[Any, ...]] = []
    ptrs: list[int] = []
    for t in chunks:
        if (t.storage_offset() * t.itemsize + t.nbytes) > t.untyped_storage().nbytes():
            return None
        meta.append((t.shape, t.stride(), _CODES[t.dtype], _CODES[t.device], t.is_inference()))
        ptrs.append(t.data_ptr())
    return meta, ptrs


class PlanCache:
    """Validated plans by request and operand metadata; see the module docstring.

    Args:
        device_type: The device type the runtime serves (passed to ``plan_transfer``).
        device_index: Its index.
        capacity: Most entries kept (those validated longest ago go first).

    ``misses`` counts the lookups that validated (in full, or ``rebinds``: only the block ids
    and chunk pointers, against operands whose every other fact was validated before),
    ``hits`` those that reused the latest plan of their entry as it was.
    """

    def __init__(self, device_type: str, device_index: int | None, capacity: int = 256) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"plan cache capacity must be positive, got {capacity}", setting="capacity"
            )
        self.device_type = device_type
        self.device_index = device_index
        self.capacity = capacity
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.rebinds = 0

    def __len__(self) -> int:
        return len(self._entries)

    def plan(self, request: TransferRequest, paged: object, objects: object) -> TransferPlan:
        """The plan for this request and these operands (see :meth:`lookup`)."""
        return self.lookup(request, paged, objects).plan

    def lookup(self, request: TransferRequest, paged: object, objects: object) -> Lookup:
        """The plan for this request and these operands: rebound from the entry of their key
        when there is one, else validated now (raising exactly as ``plan_transfer``)."""
        keyed = self._key(request, paged, objects)
        if keyed is None:
            return Lookup(self._validate(request, paged, objects))
        key, ids, chunks, inference = keyed
        entry = self._entries.get(key)  # no lock: one atomic read
        if entry is not None:
            last_ids, last_chunks, last = entry.last
            if last_ids == ids and last_chunks == chunks:
                self.hits += 1  # a statistic (concurrent hits may count once)
                return Lookup(last, entry.memo, inference)
            template = entry.template
            plan = rebind_block_ids(
                template, request, None if chunks == template.object_ptrs else chunks
            )
            if plan is not None:
                entry.last = (ids, chunks, plan)
                with self._lock:
                    self.misses += 1
                    self.rebinds += 1
                return Lookup(plan, entry.memo, inference)
        plan = self._validate(request, paged, objects)
        entry = _Entry(plan, ids)
        with self._lock:
            self.misses += 1
            self._entries.pop(key, None)
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return Lookup(plan, entry.memo, inference)

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._entries.clear()

    def _validate(self, request: TransferRequest, paged: object, objects: object) -> TransferPlan:
        return plan_transfer(
            request, paged, objects, device_type=self.device_type, device_index=self.device_index
        )

    def _key(
        self, request: TransferRequest, paged: object, objects: object
    ) -> tuple[bytes, bytes, tuple[int, ...], bool] | None:
        """The entry's key, the encoded block ids, the chunks' data pointers, and whether an
        operand is an inference tensor; ``None`` for a request or operands that cannot be
        keyed (validated every time)."""
        if type(request) is not TransferRequest:
            return None
        try:
            # Encoded, not compared as Structs: ``True == 1`` and ``1.0 == 1``, but a bool
            # or float field must fail validation, never hit a cached int's plan.
            head = _encode(
                (
                    request.fmt,
                    request.direction,
                    len(request.block_ids),
                    request.chunk_size,
                    request.skip_blocks,
                    request.shape,
                )
            )
            ids = _encode(request.block_ids)
        except (TypeError, ValueError, OverflowError):  # not wire-safe
            return None
        structure: list[Any] = []
        tensors: list[torch.Tensor] = []
        if not _flatten(paged, 0, structure, tensors):
            return None
        n_paged = len(tensors)
        if not _flatten(objects, 1, structure, tensors):
            return None
        chunks = _chunks(tensors[n_paged:])
        if chunks is None:
            return None
        chunk_meta, ptrs = chunks
        meta = [_meta(t) for t in tensors[:n_paged]]
        inference = any(map(_SEVENTH, meta)) or any(map(_FIFTH, chunk_meta))
        storage = _storage(tensors[0]) if n_paged else None
        key = head + _encode((structure, meta, chunk_meta, storage))
        return key, ids, tuple(ptrs), inference
