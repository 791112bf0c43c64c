"""Validated plans, reused while their operands have not changed (pure, thread-safe).

Theory of operation. :func:`~kvactors.plans.plan_transfer` reads metadata only, so its
answer is a function of the request and of every operand's metadata: its data pointer,
storage offset, shape, stride, dtype and device, plus the operand structure (a list of
layers, ``[[K...], [V...]]``, one tensor). :class:`PlanCache` keys a validated plan by all
of it, encoded into one ``bytes`` key (the request as msgpack, so ``True`` or ``1.0`` never
pass for ``1``: every field but the block ids, then the ids; dtypes and devices as small
codes), and keeps with it every tensor's version counter (``t._version``, bumped by every
in-place write, ``set_``, ``resize_`` and in-place view op such as ``transpose_``). A lookup
recomputes the key and the versions from the operands it is given (in one call of the
compiled hot path where it is built, see :mod:`kvactors.hotpath`: the same facts, read from
each ``TensorImpl``; its keys never equal the Python walk's). Equal key and versions: the
plan is reused. All of one tensor's facts are read in one pass, and the comparison is one
dictionary lookup and one ``bytes`` comparison: after a copy evicted the CPU caches, every
stored Python object a comparison touched would cost a miss. Failed validations are never
cached (every bad call raises afresh).

Any change validates again, at the cost of what changed:

* other metadata or another request: another key, so a miss, validated in full; a stale plan
  cannot be found, whatever changed;
* other block ids on the same operands (LMCache's traffic: other blocks of the same KV cache
  into the same chunk buffers): plans sharing everything but the ids share a *geometry*
  (their key without the ids), and the geometry's last fully validated plan is rebound to
  the new ids (:func:`~kvactors.plans.rebind_block_ids`: exact ints, in range, no repeat
  among an H2D transfer's copied positions; anything else validates in full and raises as
  ``plan_transfer`` does);
* other chunk buffers of the same layout (LMCache's traffic too: each store gathers into
  buffers its host pool hands out): the chunks' data pointers and storage offsets end the
  operands' key, and everything before them (the chunks' shape, stride, dtype, device and
  the structure, the paged operands in full) is their *layout*. ``plan_transfer`` reads no
  chunk's address, so a plan of the same layout is rebound to the new ids and the new
  chunks' addresses (:func:`~kvactors.plans.rebind_block_ids`), and the kernel facts its
  geometry learned (views relative to each chunk's own storage offset) are shared;
* other versions only (data was written: another thread's scatter into the same KV cache,
  the engine's own writes): the key proves metadata and request unchanged, and no plan
  depends on data, so the block ids are validated again and the plan and its kernel stay.

The version counters also move when kvactors itself writes an operand (a gather writes the
chunks, a scatter the paged memory). After a transfer ran, :meth:`PlanCache.settle` re-reads
the versions of the side the transfer wrote and stores them with the geometry, and learns how
far the run moved them; a later run announced with :meth:`PlanCache.running` stores the
versions it will leave before it runs, so nothing is read after the copy. The other side
keeps the versions the lookup saw (a write by anybody else meanwhile validates again).
Inference tensors have no version counter; their versions are ``-1`` and every other fact is
still compared.

The cache is bounded (the plans validated longest ago go first: a hit reorders nothing, so it
takes no lock and writes nothing but a counter); misses take a lock around the dictionaries,
never around validation.
"""

from __future__ import annotations

import array
import collections
import sys
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors import hotpath
from kvactors.errors import InvalidSettingError
from kvactors.layouts import Direction
from kvactors.plans import TransferRequest, plan_transfer, rebind_block_ids

if TYPE_CHECKING:
    from kvactors.plans import TransferPlan

__all__ = ("PlanCache", "PlanTicket")

_Tensor = torch.Tensor
_LITTLE = sys.byteorder == "little"  # the encoded versions are int64 in native order
_ADDRESS = 16  # a chunk's data pointer and storage offset at the end of the operands' key
_encode = msgspec.msgpack.Encoder().encode


class _Layout:
    """What geometries differing only in their chunks' addresses share: a plan validated in
    full (rebound for other ids and chunks), the kernel facts that depend on neither, and how
    far one run moves the written tensors' versions (the same kernel path runs)."""

    __slots__ = ("bump", "delta", "geometries", "memo", "template")

    def __init__(self, plan: TransferPlan) -> None:
        self.template = plan
        self.geometries = 0  # geometries of this layout in the cache
        self.memo: dict[Any, Any] = {}  # kernel facts that depend on no id and no address
        self.delta: list[int] | None = None
        self.bump: int | None = None


class _Geometry:
    """What plans differing only in their block ids share: the operands' versions, the
    latest plan validated for them (rebound for new ids), and their layout's memo."""

    __slots__ = ("bump", "delta", "entries", "layout", "layout_key", "memo", "template", "versions")

    def __init__(
        self, plan: TransferPlan, versions: bytes, layout: _Layout, layout_key: bytes
    ) -> None:
        self.versions = versions  # the encoded version counters, one per tensor
        self.template = plan
        self.entries = 0  # plans of this geometry in the cache
        self.layout = layout
        self.layout_key = layout_key
        self.memo = layout.memo  # kernel facts that do not depend on the block ids
        # How far one run moves the version of each written tensor (learned by the first
        # settle of any plan of the layout: they run the same kernel path).
        self.delta: list[int] | None = layout.delta
        # The same delta as one integer to add to the versions read as one little-endian
        # integer (each counter one 64-bit lane; no counter gets near 2**63, so no lane
        # carries into the next); None where the delta cannot be added that way.
        self.bump: int | None = layout.bump


class _Entry:
    __slots__ = ("geo_key", "geometry", "memo", "plan", "written")

    def __init__(
        self, plan: TransferPlan, geometry: _Geometry, geo_key: bytes, written: range
    ) -> None:
        self.plan = plan
        self.geometry = geometry
        self.geo_key = geo_key
        self.written = written  # the tensors the transfer writes, as indices
        self.memo: dict[Any, Any] = {}


class PlanTicket:
    """What a lookup saw (held for one call only): its key, the operands, their encoded
    version counters, so that :meth:`PlanCache.settle` can re-read the versions of the side
    the transfer wrote, and the plan's kernel memo (index tensors and view geometry kept with
    the plan, see ``run_fast``)."""

    __slots__ = (
        "advanced",
        "entry",
        "head",
        "inference",
        "key",
        "memo",
        "objects",
        "operands",
        "paged",
        "paged_count",
        "shared",
        "versions",
    )

    def __init__(
        self,
        operands: bytes,
        versions: bytes,
        paged_count: int,
        inference: bool,
        paged: object,
        objects: object,
        head: bytes,
        ids: bytes,
    ) -> None:
        self.operands = operands  # the operands' part of the key (structure and metadata)
        self.head = head  # the encoded request without its block ids (their count is in it)
        self.key = head + ids + operands
        self.versions = versions  # int64 per tensor, -1 for an inference tensor
        self.paged_count = paged_count  # the first ``paged_count`` tensors are the paged ones
        self.paged = paged
        self.objects = objects
        self.entry: _Entry | None = None
        self.memo: dict[Any, Any] = {}
        self.advanced = False  # the lookup stored the versions this run leaves
        self.shared: dict[Any, Any] = {}  # the geometry's memo (plans of other ids share it)
        #: Whether an operand is an inference tensor (it has no version counter).
        self.inference = inference

    @property
    def chunks(self) -> int:
        """How many chunk tensors the operands hold (their addresses end ``operands``)."""
        return len(self.versions) // 8 - self.paged_count


_T = "t"  # a tensor's place in the structure
_TS = "*"  # a sequence of nothing but tensors (its length is before it)
_TENSOR_TYPES: set[type] = {
    _Tensor
}  # tensor classes seen in operand lists (grows by subclasses met)


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


def _tensor_types(kinds: set[type]) -> bool:
    if all(issubclass(k, _Tensor) for k in kinds):
        _TENSOR_TYPES.update(kinds)
        return True
    return False


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
    # Per distinct element type, not per element: 64 layers of one tensor type are one check.
    kinds = set(map(type, value))
    if kinds <= _TENSOR_TYPES or _tensor_types(kinds):
        structure.append(_TS)
        tensors.extend(value)
        return True
    for v in value:  # one frame per list, not per tensor
        if isinstance(v, _Tensor):
            structure.append(_T)
            tensors.append(v)
        elif not _flatten(v, depth + 1, structure, tensors):
            return False
    return True


def _meta(tensors: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Per tensor, in ONE pass (each tensor's metadata is read while it is in cache): data
    pointer, storage offset, shape, stride, and the codes of its dtype and device."""
    codes = _CODES
    return [
        (t.data_ptr(), t.storage_offset(), t.shape, t.stride(), codes[t.dtype], codes[t.device])
        for t in tensors
    ]


def _ints(encoded: bytes) -> array.array[int]:
    """Encoded version counters (int64, native order) as a mutable array."""
    out = array.array("q")
    out.frombytes(encoded)
    return out


def _versions(tensors: list[torch.Tensor] | Any) -> list[int]:
    """Per tensor, its version counter; ``-1`` for an inference tensor, which has none."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference tensor in the list
        return [-1 if t.is_inference() else t._version for t in tensors]


def _issue(entry: _Entry, ticket: PlanTicket) -> tuple[TransferPlan, PlanTicket]:
    ticket.entry, ticket.memo, ticket.shared = entry, entry.memo, entry.geometry.memo
    return entry.plan, ticket


def _without_ids(request: TransferRequest) -> tuple[Any, ...]:
    return (
        request.fmt,
        request.direction,
        len(request.block_ids),
        request.chunk_size,
        request.skip_blocks,
        request.shape,
    )


class PlanCache:
    """Validated plans by (request, operand fingerprint); see the module docstring.

    Args:
        device_type: The device type the runtime serves (passed to ``plan_transfer``).
        device_index: Its index.
        capacity: Most plans kept (those validated longest ago go first).
    """

    def __init__(
        self,
        device_type: str,
        device_index: int | None,
        capacity: int = 256,
        *,
        compiled: bool | None = None,
    ) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"plan cache capacity must be positive, got {capacity}", setting="capacity"
            )
        self.device_type = device_type
        self.device_index = device_index
        self.capacity = capacity
        # Oldest first. An OrderedDict: popping a plain dict's first key again and again scans
        # the dummies its deletions left at the front.
        self._plans: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._geometries: dict[bytes, _Geometry] = {}
        self._layouts: dict[bytes, _Layout] = {}
        self._lock = threading.Lock()
        native = hotpath.load() if compiled is None or compiled else None
        if compiled and native is None:
            raise InvalidSettingError(
                f"compiled=True but the hot path is not loadable: {hotpath.status()}",
                setting="compiled",
            )
        self._walk = None if native is None else native.operand_key
        self._touched = None if native is None else native.touched_blocks
        self.hits = 0
        self.misses = 0
        self.rebinds = 0

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
        the ticket to :meth:`settle` once the transfer ran.

        ``misses`` counts the calls that validated (in full, or ``rebinds``: only the block
        ids, against operands whose every metadata fact was validated before), ``hits`` those
        that reused a plan."""
        ticket = self._ticket(request, paged, objects)
        template = None
        object_ptrs = None
        if ticket is not None:
            versions = ticket.versions
            entry = self._plans.get(ticket.key)  # a hit takes no lock: one atomic read
            if entry is not None:
                if entry.geometry.versions == versions:
                    self.hits += 1  # a statistic (concurrent hits may count once)
                    return _issue(entry, ticket)
                # The same metadata and request (the key), other versions: data moved, which
                # no plan depends on. The block ids are validated again; plan and kernel stay.
                if rebind_block_ids(entry.plan, request, None, self._touched) is not None:
                    with self._lock:
                        self.misses += 1
                        self.rebinds += 1
                        entry.geometry.versions = versions
                    return _issue(entry, ticket)
            head = ticket.head
            gkey = head + ticket.operands
            lkey = head + ticket.operands[: len(ticket.operands) - _ADDRESS * ticket.chunks]
            geo = self._geometries.get(gkey)
            if geo is not None:
                template = geo.template
            else:  # other chunk buffers of a known layout: rebound to their addresses too
                layout = self._layouts.get(lkey)
                if layout is not None:
                    template = layout.template
                    addresses = _ints(ticket.operands[len(lkey) - len(head) :])
                    object_ptrs = tuple(addresses[0::2])
        plan = (
            None
            if template is None
            else rebind_block_ids(template, request, object_ptrs, self._touched)
        )
        rebound = plan is not None
        if plan is None:
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
                self._keep(plan, ticket, gkey, lkey, rebound=rebound)
        return plan, ticket

    def _keep(
        self, plan: TransferPlan, ticket: PlanTicket, gkey: bytes, lkey: bytes, *, rebound: bool
    ) -> None:
        # Under the lock. A plan validated in full becomes its geometry's template, and its
        # layout's; the versions the lookup saw become the geometry's (same metadata: the key
        # says so).
        if rebound:
            self.rebinds += 1
        old = self._plans.pop(ticket.key, None)
        if old is not None:  # first: dropping it may forget its geometry
            self._drop(old)
        versions = ticket.versions
        geo = self._geometries.get(gkey)
        if geo is None:
            layout = self._layouts.get(lkey)
            if layout is None:
                layout = self._layouts[lkey] = _Layout(plan)
            elif not rebound:
                layout.template = plan
            layout.geometries += 1
            geo = self._geometries[gkey] = _Geometry(plan, versions, layout, lkey)
        else:
            geo.versions = versions
            if not rebound:
                geo.template = plan
                geo.layout.template = plan
        n, p = len(ticket.versions) // 8, ticket.paged_count
        written = range(p, n) if plan.direction == Direction.D2H else range(p)
        entry = _Entry(plan, geo, gkey, written)
        geo.entries += 1
        ticket.entry, ticket.memo, ticket.shared = entry, entry.memo, geo.memo
        self._plans[ticket.key] = entry
        while len(self._plans) > self.capacity:
            self._drop(self._plans.popitem(last=False)[1])

    def _drop(self, gone: _Entry) -> None:
        geo = gone.geometry
        geo.entries -= 1
        if geo.entries == 0 and self._geometries.get(gone.geo_key) is geo:
            del self._geometries[gone.geo_key]
            layout = geo.layout
            layout.geometries -= 1
            if layout.geometries == 0 and self._layouts.get(geo.layout_key) is layout:
                del self._layouts[geo.layout_key]

    def running(self, ticket: PlanTicket | None) -> None:
        """The transfer of ``ticket`` runs now (call :meth:`settle` after it ran, or
        :meth:`failed` if it did not): when its plan ran before, store the versions its own
        writes will leave, so that :meth:`settle` reads nothing after the copy."""
        if ticket is None or ticket.entry is None:
            return
        entry = ticket.entry
        geometry = entry.geometry
        bump = geometry.bump
        if bump is not None and not ticket.inference:  # one addition instead of a loop
            versions = ticket.versions
            geometry.versions = (int.from_bytes(versions, "little") + bump).to_bytes(
                len(versions), "little"
            )
            ticket.advanced = True
            return
        delta = geometry.delta
        if delta is None:
            return
        # Stored before the run, while the operands' metadata is in cache. A write by anybody
        # else, before or during the run, leaves other versions: the next lookup validates.
        now = _ints(ticket.versions)
        for k, i in enumerate(entry.written):
            if now[i] != -1:  # an inference tensor has no version counter
                now[i] += delta[k]
        geometry.versions = now.tobytes()
        ticket.advanced = True

    def failed(self, ticket: PlanTicket | None) -> None:
        """The transfer of ``ticket`` did not run to its end: its operands' versions are
        unknown, so the next lookup of these operands validates again."""
        if ticket is not None and ticket.entry is not None:
            ticket.entry.geometry.versions = b""

    def settle(self, plan: TransferPlan, ticket: PlanTicket | None) -> None:
        """After ``plan`` ran: keep the operands' current version counters with its entry.

        Only the versions of the side the transfer wrote are re-read (a gather writes the
        chunks, a scatter the paged memory), and how far the run moved them is learned: a
        later run announced with :meth:`running` stores its versions before it runs, and its
        settle reads nothing. The other side keeps the versions the lookup saw, so a write by
        anybody else meanwhile still re-validates the next call. Every other fact is in the
        key, so the entry can only ever match operands whose metadata was validated."""
        if ticket is None or ticket.entry is None or ticket.advanced:
            return
        entry, seen = ticket.entry, _ints(ticket.versions)
        written = entry.written
        tensors: list[torch.Tensor] = []
        _flatten(ticket.paged, 0, [], tensors)
        _flatten(ticket.objects, 1, [], tensors)
        after = _versions(tensors[written.start : written.stop])
        delta = [a - b for a, b in zip(after, seen[written.start : written.stop], strict=True)]
        bump = (
            sum(d << (64 * i) for i, d in zip(written, delta, strict=True))
            if _LITTLE and all(d >= 0 for d in delta)
            else None
        )
        geo = entry.geometry
        geo.delta = geo.layout.delta = delta
        geo.bump = geo.layout.bump = bump
        seen[written.start : written.stop] = array.array("q", after)
        entry.geometry.versions = seen.tobytes()

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()
            self._geometries.clear()
            self._layouts.clear()

    def _ticket(
        self, request: TransferRequest, paged: object, objects: object
    ) -> PlanTicket | None:
        if type(request) is not TransferRequest:
            return None
        try:
            # The encoded request, not the Struct: ``True == 1`` and ``1.0 == 1`` compare equal,
            # but a bool or float field must fail validation, never hit a cached int's plan.
            # In two parts: a miss on other ids finds the geometry by the first.
            head = _encode(_without_ids(request))
            ids = _encode(request.block_ids)
        except (TypeError, ValueError, OverflowError):  # not wire-safe: validate every time
            return None
        walk = self._walk
        if walk is not None:  # the compiled walk: the same facts, in one call
            found = walk(paged, objects)
            if found is not None:
                return PlanTicket(*found, paged, objects, head, ids)
        structure: list[Any] = []
        tensors: list[torch.Tensor] = []
        if not _flatten(paged, 0, structure, tensors):
            return None
        n_paged = len(tensors)
        if not _flatten(objects, 1, structure, tensors):
            return None
        # Its own encoding (msgpack, where the compiled walk's starts with a negative int64
        # tag): a key of one walk never equals a key of the other. As in the compiled walk,
        # the chunks' data pointers and storage offsets end it (16 bytes per chunk).
        chunks = tensors[n_paged:]
        meta = _meta(tensors[:n_paged]) + [m[2:] for m in _meta(chunks)]
        addresses = array.array("q")
        for t in chunks:
            addresses.append(t.data_ptr())
            addresses.append(int(t.storage_offset()))
        operands = _encode((structure, meta)) + addresses.tobytes()
        seen = _versions(tensors)
        versions = array.array("q", seen).tobytes()
        return PlanTicket(operands, versions, n_paged, -1 in seen, paged, objects, head, ids)
