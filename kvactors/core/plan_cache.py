"""Validated plans, reused while their operands' metadata has not changed (pure, thread-safe).

:class:`PlanCache` keys an entry by the request without its block ids plus every operand's
metadata except the chunks' addresses (one tuple of exact facts, the request part encoded);
a hit rebinds the validated plan to the call's block ids and chunks (only the ids are
checked, as :func:`~kvactors.core.plans.rebind_block_ids` checks them), anything else
validates in full. Failed validations are never cached; the cache is bounded (oldest first)
and a hit takes no lock. A lookup of lists of tensors (of one class each) is one Python frame.
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import msgspec
import torch

from kvactors.core.layouts import Direction
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
        staged: A device plan's staged-path binding
            (:class:`kvactors.kernels._bound.StagedBinding`), ``False`` where none applies,
            ``None`` until the entry's first run decided.
    """

    __slots__ = ("binder", "last", "staged")

    def __init__(self) -> None:
        self.binder: Binder | None = None
        self.last: tuple[tuple[int, ...], Kernel] | None = None
        self.staged: Any = None


_Tensor = torch.Tensor
_encode = msgspec.msgpack.Encoder().encode
_replace = msgspec.structs.replace


class Lookup(NamedTuple):
    """What :meth:`PlanCache.lookup` found: the plan, and for a keyed request its kernels'
    memo and whether an operand is an inference tensor (the kernel then runs in inference
    mode)."""

    plan: TransferPlan
    memo: KernelMemo | None = None
    inference: bool = False


# A Lookup made without the Python frame of its generated ``__new__``.
_new_lookup: Callable[[type[Lookup], tuple[TransferPlan, KernelMemo | None, bool]], Lookup]
_new_lookup = tuple.__new__  # type: ignore[assignment]


class _Entry:
    """A plan validated in full for one key (the template), the latest lookup issued for it
    with its encoded block ids and chunk pointers, the kernels' memo, and the template's
    facts a rebind of its ids reads."""

    __slots__ = ("h2d", "last", "memo", "moved", "n_moved", "nb", "template")

    def __init__(self, plan: TransferPlan, ids: bytes, inference: bool) -> None:
        self.template = plan
        self.memo = KernelMemo()
        self.last: tuple[bytes, tuple[int, ...], Lookup] = (
            ids,
            plan.object_ptrs,
            _new_lookup(Lookup, (plan, self.memo, inference)),
        )
        segs = plan.segments
        # The ids the segments move are one slice of them when the segments abut (the
        # common case, rebound in line); else ``None`` (rebound by ``rebind_block_ids``).
        abut = bool(segs) and all(b.start == a.stop for a, b in itertools.pairwise(segs))
        self.moved = slice(segs[0].start, segs[-1].stop) if abut else None
        self.n_moved = segs[-1].stop - segs[0].start if abut else 0
        self.nb = plan.request.shape.nb
        self.h2d = plan.direction is Direction.H2D


_T = "t"  # a tensor's place in the structure
_TS = "*"  # a sequence of nothing but tensors (its length is before it)
_TENSOR_TYPES: set[type] = {_Tensor}  # tensor classes seen in operand lists
_INTS = {int}

# Tensor facts, read by ``map`` over the operands: torch.Tensor's own methods for plain
# tensors, by name for others (a subclass's Python methods and properties apply, as in
# ``plan_transfer``); data pointer, storage offset, stride, inference flag, storage, the
# storage's size. Read with torch function dispatch off (``_NO_TORCH_FUNCTION``): a
# subclass's ``__torch_function__`` runs for none of them (the tensor's own metadata, what
# its kernels' views address), so a subclass whose ``__torch_function__`` answers these
# reads in Python (a fake device's tensors) costs no more per fact than a plain tensor.
_METHODS = ("data_ptr", "storage_offset", "stride", "is_inference", "untyped_storage", "nbytes")
_PLAIN_READERS: tuple[Callable[[Any], Any], ...] = (
    *(getattr(_Tensor, name) for name in _METHODS[:-1]),
    torch.UntypedStorage.nbytes,
)
_ANY_READERS: tuple[Callable[[Any], Any], ...] = tuple(map(operator.methodcaller, _METHODS))
_PLAIN = {_Tensor}
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_PAGED_ATTRS = operator.attrgetter("shape", "dtype", "device")
_CHUNK_ATTRS = operator.attrgetter("shape", "dtype", "device", "itemsize", "nbytes")
# Errors of reading a fact of a tensor without one (no storage, a sparse layout): such
# operands are validated, which refuses them with the specific error.
_FACT_ERRORS = (RuntimeError, NotImplementedError, TypeError, AttributeError)


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


def _nested(
    paged: object, objects: object
) -> tuple[tuple[Any, ...], Sequence[torch.Tensor], Sequence[torch.Tensor]] | None:
    """The structure, paged tensors and chunks of operands :meth:`PlanCache.lookup`'s flat
    check did not take (nested lists, tensor subclasses, anything but lists or tuples of
    plain tensors); ``None`` when they cannot be keyed."""
    structure: list[Any] = []
    tensors: list[torch.Tensor] = []
    if not _flatten(paged, 0, structure, tensors):
        return None
    n_paged = len(tensors)
    if not _flatten(objects, 1, structure, tensors):
        return None
    return tuple(structure), tensors[:n_paged], tensors[n_paged:]


class PlanCache:
    """Validated plans by request and operand metadata; see the module docstring.

    Args:
        device_type: The device type the runtime serves (passed to ``plan_transfer``).
        device_index: Its index.
        capacity: Most entries kept (those validated longest ago go first).

    ``misses`` counts the lookups that validated (in full, or ``rebinds``: only the block ids
    and chunk pointers, against operands whose every other fact was validated before),
    ``hits`` those that reused the latest plan of their entry as it was. Hits and rebinds
    are counted without a lock: exact while lookups are serialized (the GatherActor's turns
    are), concurrent ones may count once.
    """

    def __init__(self, device_type: str, device_index: int | None, capacity: int = 256) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"plan cache capacity must be positive, got {capacity}", setting="capacity"
            )
        self.device_type = device_type
        self.device_index = device_index
        self.capacity = capacity
        self._entries: collections.OrderedDict[tuple[Any, ...], _Entry] = collections.OrderedDict()
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
        when there is one, else validated now (raising exactly as ``plan_transfer``).

        The key: the encoded request without its ids, the operands' structure (container
        types, or for nested ones their markers and lengths), every paged tensor's data
        pointer, storage offset, shape, stride, dtype, device and inference flag, the
        first paged tensor's storage (identity and size), and every chunk's shape, stride,
        dtype, device and inference flag (a chunk outside its storage is not keyed). The
        encoded ids and the chunks' data pointers pick the entry's latest plan, or rebind
        the entry's template to them."""
        # One frame: the facts are read by ``map`` over the operands, the rebind of the
        # common case (exact int ids, abutting segments) is in line.
        if type(request) is not TransferRequest:
            return Lookup(self._validate(request, paged, objects))
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
        except (TypeError, ValueError, OverflowError):  # not wire-safe: validated
            return Lookup(self._validate(request, paged, objects))
        # Lists or tuples of tensors of one class each (or one plain paged tensor): the flat
        # check, by torch.Tensor's own methods for plain tensors, by name for a subclass
        # (whose class is then part of the key).
        tp, to = type(paged), type(objects)
        kinds_o = set(map(type, objects)) if to is list or to is tuple else None  # type: ignore[call-overload]
        if tp is _Tensor:
            kinds_p: set[Any] | None = _PLAIN
        else:
            kinds_p = set(map(type, paged)) if tp is list or tp is tuple else None  # type: ignore[call-overload]
        units: Sequence[torch.Tensor]
        chunks: Sequence[torch.Tensor]
        if kinds_o == _PLAIN and kinds_p == _PLAIN:
            structure: tuple[Any, ...] | None = (tp, to)
            readers = _PLAIN_READERS
        elif (
            kinds_o is not None
            and kinds_p is not None
            and len(kinds_o) == 1
            and len(kinds_p) == 1
            and issubclass(next(iter(kinds_p)), _Tensor)
            and issubclass(next(iter(kinds_o)), _Tensor)
        ):
            structure = (tp, to, *kinds_p, *kinds_o)
            readers = _ANY_READERS
        else:
            structure = None
        if structure is not None:  # the flat structure: the paged tensors and the chunks
            units = (paged,) if tp is _Tensor else paged  # type: ignore[assignment]
            chunks = objects  # type: ignore[assignment]
        else:
            nested = _nested(paged, objects)
            if nested is None:
                return Lookup(self._validate(request, paged, objects))
            structure, units, chunks = nested
            readers = _ANY_READERS
        data_ptr, storage_offset, stride, is_inference, untyped_storage, nbytes = readers
        inside = True  # every chunk within its storage
        try:
            with _NO_TORCH_FUNCTION():
                p_inference = tuple(map(is_inference, units))
                c_inference = tuple(map(is_inference, chunks))
                if units:
                    s = untyped_storage(units[0])
                    storage: tuple[int, int] | None = (s._cdata, nbytes(s))
                else:
                    storage = None
                c_attrs = tuple(map(_CHUNK_ATTRS, chunks))
                key = (
                    head,
                    structure,
                    tuple(map(data_ptr, units)),
                    tuple(map(storage_offset, units)),
                    tuple(map(_PAGED_ATTRS, units)),
                    tuple(map(stride, units)),
                    p_inference,
                    storage,
                    c_attrs,
                    tuple(map(stride, chunks)),
                    c_inference,
                )
                ptrs = tuple(map(data_ptr, chunks))
                # A chunk outside its storage (a storage may shrink under a chunk after its plan
                # was made) is not keyed: validation refuses it.
                for (_, _, _, itemsize, size), offset, room in zip(
                    c_attrs,
                    map(storage_offset, chunks),
                    map(nbytes, map(untyped_storage, chunks)),
                    strict=True,
                ):
                    if offset * itemsize + size > room:
                        inside = False
                        break
        except _FACT_ERRORS:  # a tensor without these facts: validated, and refused
            return Lookup(self._validate(request, paged, objects))
        if not inside:
            return Lookup(self._validate(request, paged, objects))
        inference = True in p_inference or True in c_inference
        try:
            entry: _Entry | None = self._entries[key]  # no lock: one atomic read
        except KeyError:
            entry = None
        if entry is not None:
            last_ids, last_ptrs, found = entry.last
            if last_ids == ids and last_ptrs == ptrs:
                self.hits += 1  # a statistic (concurrent hits may count once)
                return found
            template = entry.template
            block_ids = request.block_ids  # as many as the template's (the key has the count)
            moved = entry.moved
            plan: TransferPlan | None
            if (
                moved is not None
                and type(block_ids) is tuple
                and block_ids
                and set(map(type, block_ids)) == _INTS
                and min(block_ids) >= 0
                and max(block_ids) < entry.nb
            ):
                # ``rebind_block_ids`` for exact int ids and abutting segments, in line.
                touched = frozenset(block_ids[moved])
                if entry.h2d and len(touched) != entry.n_moved:
                    plan = None  # a repeated id among an H2D's copied positions
                elif ptrs == template.object_ptrs:
                    plan = _replace(template, request=request, touched_blocks=touched)
                else:
                    plan = _replace(
                        template, request=request, touched_blocks=touched, object_ptrs=ptrs
                    )
            else:
                plan = rebind_block_ids(
                    template, request, None if ptrs == template.object_ptrs else ptrs
                )
            if plan is not None:
                found = _new_lookup(Lookup, (plan, entry.memo, inference))
                entry.last = (ids, ptrs, found)
                # Statistics without a lock: exact when lookups are serialized (the
                # GatherActor's turns are), concurrent ones may count once.
                self.misses += 1
                self.rebinds += 1
                return found
        plan = self._validate(request, paged, objects)
        entry = _Entry(plan, ids, inference)
        with self._lock:
            self.misses += 1
            self._entries.pop(key, None)
            self._entries[key] = entry
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return entry.last[2]

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._entries.clear()

    def _validate(self, request: TransferRequest, paged: object, objects: object) -> TransferPlan:
        return plan_transfer(
            request, paged, objects, device_type=self.device_type, device_index=self.device_index
        )
