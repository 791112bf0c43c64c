"""Transfer requests and plans: validate everything, then describe the copy (pure).

:func:`plan_transfer` is the only gate between a request and memory: it reads metadata only
and raises before anything is copied, in LMCache's order and exception families
(``ValueError`` for bad values, ``TypeError`` for operands of the wrong structure). The
:class:`TransferPlan` holds no tensors: the segment mapping, the blocks touched, the bytes, and
layout facts the kernels use; kernels check its fingerprint (data pointers) before running.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvactors.core._plan_checks import (
    check_objects,
    check_objects_structure,
    check_paged_tensors,
    non_overlapping,
    normalize_paged,
    resolve_dtype,
    unit_strides,
)
from kvactors.core.layouts import Direction, FormatSpec, KVFormat, PagedKind, ShapeDesc, format_spec
from kvactors.errors import OperandTypeError, TransferValidationError

if TYPE_CHECKING:
    import torch

__all__ = (
    "RowGeometry",
    "Segment",
    "StackedView",
    "TransferPlan",
    "TransferRequest",
    "paged_units",
    "plan_transfer",
    "rebind_block_ids",
    "segments_for",
)


class TransferRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One ``multi_layer_block_kv_transfer`` call, without its tensors (wire-safe).

    Attributes:
        fmt: Engine KV format number (:class:`~kvactors.core.layouts.KVFormat`).
        direction: :class:`~kvactors.core.layouts.Direction` number (0 = H2D, 1 = D2H).
        block_ids: Engine block ids in chunk order.
        chunk_size: Token slots per object (``blocks_per_object * bs``).
        skip_blocks: Flat positions of ``block_ids`` to skip at the start.
        shape: The paged buffer shape descriptor.
    """

    fmt: int
    direction: int
    block_ids: tuple[int, ...]
    chunk_size: int
    skip_blocks: int = 0
    shape: ShapeDesc


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """One object's covered range: ``block_ids[start:stop]`` <-> rows from ``row0``."""

    obj: int
    row0: int
    slot0: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        """Blocks moved for this object."""
        return self.stop - self.start


class StackedView(msgspec.Struct, frozen=True, kw_only=True):
    """``as_strided`` geometry, over the first paged tensor's storage, of one canonical
    ``[L, P, B, S, H, D]`` view covering every paged tensor."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


class RowGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The stacked storage seen as rows of one block plane (``BS*NH*HS`` elements each).

    Row of ``(plane p, layer l, block b)`` is ``plane_layer_rows[p*NL + l] + b*block_rows``
    in ``as_strided([nrows, piece], [row_stride, 1], storage_offset)``.
    """

    row_stride: int
    nrows: int
    storage_offset: int
    piece: int
    plane_layer_rows: tuple[int, ...]
    block_rows: int


class TransferPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A validated transfer: what moves where, with no tensors inside.

    Attributes:
        request: The validated request.
        spec: Facts about the format.
        direction: The direction.
        dtype: torch dtype name of every operand.
        itemsize: Bytes per element.
        device: The paged tensors' device (``"cpu"``, ``"mlu:0"``).
        on_host: Whether the paged tensors are CPU tensors (else the staged device path runs).
        segments: One entry per object that is read or written.
        touched_blocks: Engine block ids actually moved.
        nbytes: Bytes moved.
        tight: Every block plane is one contiguous run, laid out as its object rows.
        stacked: One strided view covers all paged tensors (``None`` if not).
        rows: Row geometry of the stacked view when it is also tight (``None`` if not).
        paged_ptrs: Data pointers of the paged tensors (fingerprint).
        object_ptrs: Data pointers of the objects (fingerprint).
    """

    request: TransferRequest
    spec: FormatSpec
    direction: Direction
    dtype: str
    itemsize: int
    device: str
    on_host: bool
    segments: tuple[Segment, ...]
    touched_blocks: frozenset[int]
    nbytes: int
    tight: bool
    stacked: StackedView | None
    rows: RowGeometry | None
    paged_ptrs: tuple[int, ...]
    object_ptrs: tuple[int, ...]

    @property
    def fmt(self) -> KVFormat:
        """The format."""
        return self.spec.fmt


def _int_field(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OperandTypeError(f"{field} must be an int, got {value!r}", field=field)
    return value


def segments_for(
    n_objects: int, block_ids_len: int, bpo: int, skip: int, bs: int
) -> tuple[Segment, ...]:
    """The per-object ranges of contract 3.2 (objects processed independently).

    Object ``c`` covers flat positions ``[max(c*bpo, skip), min(c*bpo + bpo, N))``; an empty
    range leaves it untouched, and positions past ``n_objects*bpo`` are ignored.
    """
    out: list[Segment] = []
    for c in range(n_objects):
        lo = max(c * bpo, skip)
        hi = min(c * bpo + bpo, block_ids_len)
        if lo >= hi:
            continue
        slot0 = lo - c * bpo
        out.append(Segment(obj=c, row0=slot0 * bs, slot0=slot0, start=lo, stop=hi))
    return tuple(out)


def paged_units(spec: FormatSpec, paged: object) -> list[torch.Tensor]:
    """The paged tensors as a flat list: one per layer, ``[K..., V...]`` for K/V lists, or the
    single cross-layer tensor. Raises like :func:`plan_transfer` on a bad structure."""
    return normalize_paged(spec, paged)


def _stacked(spec: FormatSpec, shape: ShapeDesc, units: list[torch.Tensor]) -> StackedView | None:
    """Whether one ``[L, P, B, S, H, D]`` strided view over the first unit's storage covers
    every unit (metadata only): every unit is a view of that same storage (identity, not an
    equal base pointer: views made from a raw pointer each have their own storage, sized to
    reach their own elements only), at offsets of one uniform layer and plane stride, and the
    view lies inside the storage."""
    nl, planes = shape.nl, spec.planes
    size = (nl, planes, shape.nb, shape.bs, shape.nh, shape.hs)
    if spec.kind is PagedKind.CROSS_LAYER:
        t = units[0]
        st = dict(zip(spec.axes, t.stride(), strict=True))
        stride = tuple(st[a] for a in "LPBSHD")
        return StackedView(size=size, stride=stride, storage_offset=int(t.storage_offset()))
    first = units[0]
    storage = first.untyped_storage()
    stride0 = first.stride()
    inner = unit_strides(spec, first)
    offsets: list[int] = []
    for t in units:
        if t.stride() != stride0 or t.untyped_storage()._cdata != storage._cdata:
            return None
        offsets.append(int(t.storage_offset()))
    o0 = offsets[0]
    if spec.is_kv_list:
        sl = offsets[1] - o0 if nl > 1 else 0
        sp = offsets[nl] - o0
        expect = [o0 + p * sp + layer * sl for p in range(2) for layer in range(nl)]
    else:
        sl = offsets[1] - o0 if nl > 1 else 0
        sp = inner["P"]
        expect = [o0 + layer * sl for layer in range(nl)]
    if offsets != expect or sl < 0 or sp < 0:
        return None
    stride = (sl, sp, inner["B"], inner["S"], inner["H"], inner["D"])
    if not non_overlapping(size, stride):
        return None
    end = o0 + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1
    if end * first.element_size() > storage.nbytes():
        return None
    return StackedView(size=size, stride=stride, storage_offset=o0)


def _tight(shape: ShapeDesc, units: list[torch.Tensor], spec: FormatSpec) -> bool:
    """Every block plane ``[S, H, D]`` is one contiguous token-major run."""
    if spec.is_hnd:
        return False
    want = {"S": shape.nh * shape.hs, "H": shape.hs, "D": 1}
    sizes = {"S": shape.bs, "H": shape.nh, "D": shape.hs}
    for stride in {t.stride() for t in units}:
        st = dict(zip(spec.axes, stride, strict=True))
        if any(sizes[a] > 1 and st.get(a, 0) != want[a] for a in "SHD"):
            return False
    return True


def _rows(shape: ShapeDesc, stacked: StackedView, planes: int) -> RowGeometry:
    nl, nb = shape.nl, shape.nb
    sl, sp, sb = stacked.stride[0], stacked.stride[1], stacked.stride[2]
    piece = shape.bs * shape.nh * shape.hs
    g = 0
    for n, s in ((nl, sl), (planes, sp), (nb, sb)):
        if n > 1:
            g = math.gcd(g, s)
    if g == 0:
        g = piece
    span = (nl - 1) * sl + (planes - 1) * sp + (nb - 1) * sb
    return RowGeometry(
        row_stride=g,
        nrows=span // g + 1,
        storage_offset=stacked.storage_offset,
        piece=piece,
        plane_layer_rows=tuple(
            (layer * sl + p * sp) // g for p in range(planes) for layer in range(nl)
        ),
        block_rows=sb // g,
    )


def _check_shape_desc(spec: FormatSpec, shape: ShapeDesc) -> None:
    for name in ("nl", "nb", "nh", "hs", "element_size"):
        if _int_field(getattr(shape, name), name) <= 0:
            raise TransferValidationError(f"shape.{name} must be positive", field=name)
    if _int_field(shape.kv_size, "kv_size") != spec.planes:
        raise TransferValidationError(
            f"format {spec.fmt.name} needs kv_size={spec.planes}, got {shape.kv_size}",
            field="kv_size",
        )
    if spec.is_mla and shape.nh != 1:
        raise TransferValidationError(f"MLA needs nh=1, got {shape.nh}", field="nh")
    bse = _int_field(shape.block_stride_elems, "block_stride_elems")
    if bse < 0 or (bse and not spec.allows_block_padding):
        raise TransferValidationError(
            f"block_stride_elems={bse} is not allowed for {spec.fmt.name}",
            field="block_stride_elems",
        )


def _check_block_ids(
    request: TransferRequest, nb: int, segments: tuple[Segment, ...]
) -> frozenset[int]:
    ids = request.block_ids
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise OperandTypeError("block_ids must be a sequence of ints", field="block_ids")
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int):
            raise OperandTypeError(f"block_ids must hold ints, got {b!r}", field="block_ids")
        if not 0 <= b < nb:
            raise TransferValidationError(
                f"block id {b} is out of range [0, {nb})", field="block_ids"
            )
    moved = [b for s in segments for b in ids[s.start : s.stop]]
    touched = frozenset(moved)
    if request.direction == Direction.H2D and len(touched) != len(moved):
        raise TransferValidationError(
            "duplicate block ids in an H2D transfer (the write order would be undefined)",
            field="block_ids",
        )
    return touched


def plan_transfer(
    request: TransferRequest,
    paged: object,
    objects: object,
    *,
    device_type: str,
    device_index: int | None = None,
) -> TransferPlan:
    """Validate a transfer and describe it; touches no tensor data.

    Args:
        request: What to move.
        paged: Paged KV tensors: per-layer sequence, ``[[K...], [V...]]`` (or flat
            ``[K..., V...]``) for format 9, ``[(K, V), ...]`` for format 16, one tensor for
            the cross-layer formats 0 and 8.
        objects: Host chunks: CPU, contiguous, ``[2, NL, T, NH*HS]`` (one-plane formats, MLA
            and fused K/V: ``[NL, T, NH*HS]``).
        device_type: Device type the paged tensors must live on (``"cpu"``, ``"mlu"``, ...).
        device_index: Device index they must live on (``None``: any, but one).

    Returns:
        The plan.

    Raises:
        TransferValidationError: A bad value (a ``ValueError``); see the module docstring.
        OperandTypeError: An operand of the wrong structure (a ``TypeError``).
    """
    if not isinstance(request, TransferRequest):
        raise OperandTypeError("request must be a TransferRequest", field="request")
    shape = request.shape
    if not isinstance(shape, ShapeDesc):
        raise OperandTypeError("request.shape must be a ShapeDesc", field="shape")
    chunk = _int_field(request.chunk_size, "chunk_size")
    if chunk <= 0:
        raise TransferValidationError(
            f"chunk size must be positive, got {chunk}", field="chunk_size"
        )
    bs = _int_field(shape.bs, "bs")
    if bs <= 0 or chunk % bs:
        raise TransferValidationError(
            f"chunk size {chunk} must be a positive multiple of shape_desc.bs ({bs})", field="bs"
        )
    skip = _int_field(request.skip_blocks, "skip_blocks")
    if skip < 0:
        raise TransferValidationError(f"skip_blocks must be >= 0, got {skip}", field="skip_blocks")
    direction = _int_field(request.direction, "direction")
    if direction not in (0, 1):
        raise TransferValidationError(
            f"direction must be 0 or 1, got {direction}", field="direction"
        )
    spec = format_spec(request.fmt)
    if spec is None:
        raise TransferValidationError(f"unsupported engine KV format {request.fmt!r}", field="fmt")
    dtype = resolve_dtype(shape, paged, objects)
    units = normalize_paged(spec, paged)
    objs = check_objects_structure(objects)
    _check_shape_desc(spec, shape)
    expected_units = {PagedKind.CROSS_LAYER: 1, PagedKind.LAYER_LIST: shape.nl}.get(
        spec.kind, 2 * shape.nl
    )
    if len(units) != expected_units:
        raise TransferValidationError(
            f"{spec.fmt.name} needs {expected_units} paged tensors for nl={shape.nl}, "
            f"got {len(units)}",
            field="nl",
        )
    device = check_paged_tensors(spec, shape, units, dtype, device_type, device_index)
    check_objects(spec, shape, objs, dtype, chunk)
    bpo = chunk // bs
    segments = segments_for(len(objs), len(request.block_ids), bpo, skip, bs)
    touched = _check_block_ids(request, shape.nb, segments)
    itemsize = shape.element_size
    plane_bytes = bs * shape.nh * shape.hs * itemsize
    nbytes = sum(s.count for s in segments) * plane_bytes * spec.planes * shape.nl
    stacked = _stacked(spec, shape, units)
    tight = _tight(shape, units, spec)
    return TransferPlan(
        request=request,
        spec=spec,
        direction=Direction(direction),
        dtype=dtype,
        itemsize=itemsize,
        device=device,
        on_host=device_type == "cpu",
        segments=segments,
        touched_blocks=touched,
        nbytes=nbytes,
        tight=tight,
        stacked=stacked,
        rows=_rows(shape, stacked, spec.planes) if stacked is not None and tight else None,
        paged_ptrs=tuple(t.data_ptr() for t in units),
        object_ptrs=tuple(o.data_ptr() for o in objs),
    )


_ABUTTING: dict[int, tuple[tuple[Segment, ...], bool]] = {}
"""``id(segments)`` -> (the segments, whether they abut): a rebound plan shares its template's
segments, so each template's are checked once (the value keeps them, so the id stays theirs)."""


def _abutting(segs: tuple[Segment, ...]) -> bool:
    """Whether each segment starts where the one before it stopped."""
    known = _ABUTTING.get(id(segs))
    if known is not None and known[0] is segs:
        return known[1]
    value = all(b.start == a.stop for a, b in itertools.pairwise(segs))
    if len(_ABUTTING) >= 256:
        _ABUTTING.clear()
    _ABUTTING[id(segs)] = (segs, value)
    return value


def rebind_block_ids(
    plan: TransferPlan,
    request: TransferRequest,
    object_ptrs: tuple[int, ...] | None = None,
) -> TransferPlan | None:
    """``plan`` for ``request``, which differs from ``plan.request`` at most in the block ids
    (the same count of them): the ids are validated as :func:`plan_transfer` validates them,
    everything else was validated for the plan. ``None`` when the ids are not exact ints in
    range (or repeat among an H2D transfer's copied positions): :func:`plan_transfer` then
    validates in full and raises its specific error.

    ``object_ptrs``: the chunks are other buffers than the plan's, of the same shape, stride,
    dtype and device (``plan_transfer`` reads no chunk's address); their data pointers.

    The caller proves the rest of the request and the operands unchanged (the plan cache
    compares the encoded request without ids and every operand fact but the chunks'
    addresses, which ``object_ptrs`` gives)."""
    ids = request.block_ids
    if type(ids) is not tuple or len(ids) != len(plan.request.block_ids):
        return None
    segs = plan.segments
    if ids:
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= plan.request.shape.nb:
            return None
        if not segs:
            moved: tuple[int, ...] = ()
        elif len(segs) == 1 or _abutting(segs):
            moved = ids[segs[0].start : segs[-1].stop]
        else:
            moved = tuple(itertools.chain.from_iterable([ids[s.start : s.stop] for s in segs]))
        touched = frozenset(moved)
        if plan.direction is Direction.H2D and len(touched) != len(moved):
            return None
    else:
        touched = frozenset()
    if object_ptrs is None:
        return msgspec.structs.replace(plan, request=request, touched_blocks=touched)
    if len(object_ptrs) != len(plan.object_ptrs):
        return None
    return msgspec.structs.replace(
        plan, request=request, touched_blocks=touched, object_ptrs=object_ptrs
    )
