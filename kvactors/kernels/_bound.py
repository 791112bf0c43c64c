"""Bound staged kernels: the staged path of a device plan the plan cache matched, decided once.

:func:`kvactors.kernels._staged.staged_segment` builds a call's views from its plan on every
call: the paged view, each segment's staging shape and host view, the index kind. Those
depend on the cache entry alone (the key holds every operand fact they read), so a
:class:`StagedBinding` keeps them as geometry, decided on the entry's first run. A call then
reads its block ids' index tensors from the stream's :class:`ScratchCache` (one upload for new
ids) and, per segment, runs one kernel and one host<->device copy, exactly the torch calls of
the unbound path. The views those two read are made once too: the paged view while the call
passes the same first paged tensor (held no longer than that tensor lives), the staging
buffer's views with the buffer (in the :class:`ScratchCache`), and a whole contiguous chunk is
copied as itself, to or from its staging buffer seen in the chunk's dtype and shape: a warm call
makes two torch calls per segment and no view of its own. Paged tensors that no one view
covers (layers allocated apart) take a :class:`UnitsBinding`: the unbound path's kernel per
paged tensor (and plane, gathering), its views kept the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import Direction
from kvactors.core.plans import paged_units
from kvactors.kernels._context import KernelContext, index_values
from kvactors.kernels._staged import single_kernel
from kvactors.kernels._views import WeakHold, first_paged, physical_order, raw

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from kvactors.core.plans import TransferPlan
    from kvactors.kernels._context import ScratchCache

__all__ = ("StagedBinding", "UnitsBinding", "staged_binding")

_Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # as_strided's size, stride, offset


def _geometry(t: torch.Tensor) -> _Geometry:
    return tuple(t.shape), t.stride(), int(t.storage_offset())


class _Segment:
    """One segment's part of a binding: its chunk, staging buffer, views and index."""

    __slots__ = ("host", "obj", "staging", "start", "stop", "view", "whole")

    def __init__(
        self,
        obj: int,
        staging: tuple[int, ...],
        view: _Geometry,
        host: _Geometry,
        whole: tuple[torch.dtype, tuple[int, ...]] | None,
        start: int,
        stop: int,
    ) -> None:
        self.obj = obj  # the chunk's position in ``objects``
        self.staging = staging  # the staging buffer's shape
        self.view = view  # the kernel's view of the staging buffer
        self.host = host  # the chunk's view: offset relative to the chunk's own
        # The chunk is the segment, contiguous, of the paged dtype's width: the staging
        # buffer seen as the chunk (its dtype and shape) is copied to or from the chunk itself.
        self.whole = whole
        self.start, self.stop = start, stop  # its block ids' slice of the request's


def _non_blocking(
    must_block: Callable[[torch.Tensor, torch.Tensor], bool],
    d2h: bool,
    host: torch.Tensor,
    side: torch.Tensor,
    decided: list[bool],
) -> bool:
    # A segment's copy policy, decided on a binding's first run (the backend's must_block,
    # with the tensors the copy reads and writes) and recorded in ``decided``.
    non_blocking = not (must_block(host, side) if d2h else must_block(side, host))
    decided.append(non_blocking)
    return non_blocking


class StagedBinding(WeakHold):
    """The staged path of one cache entry's plans (see the module docstring)."""

    __slots__ = (
        "d2h",
        "device",
        "dim",
        "dtype",
        "non_blocking",
        "rows",
        "segments",
        "source",
        "staging",
    )

    def __init__(self, plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]) -> None:
        super().__init__()  # held: the first paged tensor, the paged view made of it
        units = paged_units(plan.spec, paged)
        ctx = KernelContext(plan, units)
        self.device = ctx.device
        self.d2h = plan.direction is Direction.D2H
        g = plan.rows
        if g is not None:
            rows = ctx.rows
            assert rows is not None
            self.source = _geometry(rows)
            self.dim = 0
            self.rows: tuple[tuple[int, ...], int] | None = (g.plane_layer_rows, g.block_rows)
        else:
            stacked = ctx.stacked
            assert stacked is not None
            order = physical_order(stacked)
            self.source = _geometry(stacked.permute(order))
            self.dim = order.index(2)
            self.rows = None
        self.dtype = raw(units[0]).dtype
        shape = plan.request.shape
        heads = 1 if plan.spec.is_mla else shape.nh
        segments = []
        for seg in plan.segments:
            n = seg.count
            obj = raw(objects[seg.obj])
            staging = (ctx.planes, ctx.nl, n, shape.bs, heads, shape.hs)
            meta = torch.empty(staging, dtype=obj.dtype, device="meta")
            if g is not None:
                view = _geometry(meta.view(len(g.plane_layer_rows) * n, -1))
            else:
                view = _geometry(meta.permute(1, 0, 2, 3, 4, 5).permute(order))
            if n == ctx.bpo:
                host_view = obj.view(staging)  # the whole chunk: contiguous, one plain DMA
            else:
                host_view = ctx.target_view(obj)[:, :, seg.slot0 : seg.slot0 + n]
            size, stride, offset = _geometry(host_view)
            host = (size, stride, offset - int(obj.storage_offset()))
            chunk = objects[seg.obj]
            whole = None
            if (
                n == ctx.bpo
                and chunk.is_contiguous()
                and chunk.element_size() == self.dtype.itemsize
            ):
                whole = (chunk.dtype, tuple(chunk.shape))
            segments.append(_Segment(seg.obj, staging, view, host, whole, seg.start, seg.stop))
        self.segments = tuple(segments)
        self.staging = tuple(seg.staging for seg in segments)
        # Per segment, whether its host<->device copy is non-blocking (the backend's copy
        # policy, decided on the first run, with the tensors it reads).
        self.non_blocking: tuple[bool, ...] | None = None

    def run(
        self,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        must_block: Callable[[torch.Tensor, torch.Tensor], bool],
        scratch: ScratchCache,
        keep: list[torch.Tensor],
    ) -> None:
        """Move ``plan``'s segments (a plan of this binding's entry) on the current stream;
        ``must_block`` is the backend's copy policy (decided on the first run: it reads
        nothing the entry does not fix)."""
        dev, dim, dtype, d2h = self.device, self.dim, self.dtype, self.d2h
        first = paged  # the first paged tensor (first_paged, in line)
        if not isinstance(first, torch.Tensor):
            first = first[0]
            if not isinstance(first, torch.Tensor):
                first = first[0]
        held = self.held
        if held is not None and held[0][0]() is first:
            source = held[1]
        else:
            source = first.view(dtype).as_strided(*self.source)
            self.hold((first,), source)
        block_ids = plan.request.block_ids
        rows = self.rows
        keys: list[Hashable] = []
        for s in self.segments:  # loops, not comprehensions: no Python frame
            if rows is None:
                keys.append(("ids", block_ids[s.start : s.stop]))
            else:
                keys.append(("rows", block_ids[s.start : s.stop], *rows))
        indices, buffers = scratch.fetch(dev, keys, index_values, keep, self.staging, dtype)
        flags = self.non_blocking
        decided: list[bool] = []
        views = scratch.views
        for k, (seg, idx, staging) in enumerate(zip(self.segments, indices, buffers, strict=True)):
            key = (id(staging), seg.view)  # the cache's own buffer: its id is its name
            view = views.get(key)
            if view is None:
                view = views[key] = staging.as_strided(*seg.view)
            whole = seg.whole
            if whole is None:
                side = staging
                obj = objects[seg.obj].view(dtype)
                size, stride, offset = seg.host
                host = obj.as_strided(size, stride, obj.storage_offset() + offset)
            else:
                alias = views.get((id(staging), whole))
                if alias is None:
                    alias = views[id(staging), whole] = staging.view(whole[0]).view(whole[1])
                side, host = alias, objects[seg.obj]
            if flags is None:
                non_blocking = _non_blocking(must_block, d2h, host, side, decided)
            else:
                non_blocking = flags[k]
            if d2h:
                torch.index_select(source, dim, idx, out=view)
                host.copy_(side, non_blocking=non_blocking)
            else:
                side.copy_(host, non_blocking=non_blocking)
                source.index_copy_(dim, idx, view)
        if flags is None:
            self.non_blocking = tuple(decided)


class _UnitSegment:
    """One segment's part of a :class:`UnitsBinding`: its chunk, the staging buffer's
    views the per-tensor kernels write or read, and the segment's region of the buffer."""

    __slots__ = ("kernels", "obj", "region", "staging", "start", "stop")

    def __init__(
        self,
        obj: int,
        staging: tuple[int, ...],
        kernels: tuple[tuple[int, _Geometry], ...],
        region: _Geometry | None,
        start: int,
        stop: int,
    ) -> None:
        self.obj = obj  # the chunk's position in ``objects``
        self.staging = staging  # the staging buffer's shape: the (raw) chunk's
        self.kernels = kernels  # per kernel: the paged view it reads or writes, its buffer view
        self.region = region  # the segment's part of the buffer (None: all of it)
        self.start, self.stop = start, stop  # its block ids' slice of the request's


class UnitsBinding(WeakHold):
    """The staged path of one cache entry's plans whose paged tensors share no one view
    (layers allocated apart): per segment, a gather is one ``index_select`` per paged tensor
    and plane into a staging buffer of the chunk's shape and one copy to the host chunk, a
    scatter one copy into the buffer and one ``index_copy_`` per paged tensor, exactly the
    torch calls of the unbound path. The paged tensors' views are kept while a call passes
    the same tensors (weakly: the binding keeps no tensor alive), the buffer's in the
    :class:`ScratchCache`."""

    __slots__ = ("d2h", "device", "dtype", "non_blocking", "segments")

    def __init__(self, plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]) -> None:
        super().__init__()  # held: the paged tensors, the views the kernels read or write
        units = paged_units(plan.spec, paged)
        ctx = KernelContext(plan, units)
        self.device = ctx.device
        self.d2h = plan.direction is Direction.D2H
        self.dtype = raw(objects[0]).dtype
        segments = []
        for seg in plan.segments:
            obj = raw(objects[seg.obj])
            meta = torch.empty(tuple(obj.shape), dtype=obj.dtype, device="meta")
            j0, n = seg.slot0, seg.count
            kernels: list[tuple[int, _Geometry]] = []
            if self.d2h:
                rows = ctx.plane_rows(meta)[:, j0 : j0 + n]
                for v, (_, i) in enumerate(ctx.plane_views()):
                    kernels.append((v, _geometry(rows[i])))
            else:
                ov = ctx.target_view(meta).permute(1, 0, 2, 3, 4, 5)[:, :, j0 : j0 + n]
                for v, (_, layer, planes) in enumerate(ctx.unit_views()):
                    kernels.append((v, _geometry(ov[layer, planes.start : planes.stop])))
            region = None if n == ctx.bpo else _geometry(ctx.region(meta, seg))
            segments.append(
                _UnitSegment(seg.obj, tuple(obj.shape), tuple(kernels), region, seg.start, seg.stop)
            )
        self.segments = tuple(segments)
        self.non_blocking: tuple[bool, ...] | None = None  # per segment, as StagedBinding's
        self.hold(units, self._made(ctx))

    def _made(self, ctx: KernelContext) -> list[torch.Tensor]:
        # The paged views the kernels read (gather: each tensor's planes as rows) or write.
        if self.d2h:
            return [rows for rows, _ in ctx.plane_views()]
        return [cu for cu, _, _ in ctx.unit_views()]

    def _views(self, plan: TransferPlan, units: list[torch.Tensor]) -> list[torch.Tensor]:
        # The paged views of this call's tensors: the kept ones if the call passes the
        # tensors they were made of, else made now (and kept).
        views: list[torch.Tensor] | None = self.kept(units)
        if views is not None:
            return views
        views = self._made(KernelContext(plan, units))
        self.hold(units, views)
        return views

    def run(
        self,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        must_block: Callable[[torch.Tensor, torch.Tensor], bool],
        scratch: ScratchCache,
        keep: list[torch.Tensor],
    ) -> None:
        """Move ``plan``'s segments (a plan of this binding's entry) on the current stream,
        as :meth:`StagedBinding.run`."""
        dev, d2h, dtype = self.device, self.d2h, self.dtype
        views = self._views(plan, paged_units(plan.spec, paged))
        block_ids = plan.request.block_ids
        keys: list[Hashable] = []
        shapes: list[tuple[int, ...]] = []
        for s in self.segments:
            keys.append(("ids", block_ids[s.start : s.stop]))
            shapes.append(s.staging)
        indices, buffers = scratch.fetch(dev, keys, index_values, keep, shapes, dtype)
        cached = scratch.views
        flags = self.non_blocking
        decided: list[bool] = []
        for k, (seg, idx, staging) in enumerate(zip(self.segments, indices, buffers, strict=True)):
            region = seg.region
            if region is None:  # the whole chunk: the buffer seen in the chunk's dtype
                host = objects[seg.obj]
                side = cached.get((id(staging), host.dtype))
                if side is None:
                    side = cached[id(staging), host.dtype] = staging.view(host.dtype)
            else:
                obj = objects[seg.obj].view(dtype)
                part = cached.get((id(staging), region))
                if part is None:
                    part = cached[id(staging), region] = staging.as_strided(*region)
                size, stride, offset = region
                side, host = part, obj.as_strided(size, stride, obj.storage_offset() + offset)
            if flags is None:
                non_blocking = _non_blocking(must_block, d2h, host, side, decided)
            else:
                non_blocking = flags[k]
            if not d2h:
                side.copy_(host, non_blocking=non_blocking)
            for v, geometry in seg.kernels:
                key = (id(staging), geometry)
                view = cached.get(key)
                if view is None:
                    view = cached[key] = staging.as_strided(*geometry)
                if d2h:
                    torch.index_select(views[v], 0, idx, out=view)
                else:
                    views[v].index_copy_(1, idx, view)
            if d2h:
                host.copy_(side, non_blocking=non_blocking)
        if flags is None:
            self.non_blocking = tuple(decided)


def staged_binding(
    plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]
) -> StagedBinding | UnitsBinding | None:
    """The binding of a device plan: moved one kernel per segment (a rows or stacked view),
    or one per paged tensor (and plane, for a gather of a tight plan); ``None`` where the
    unbound path serves it."""
    if plan.on_host or not plan.segments:
        return None
    units = paged_units(plan.spec, paged)
    if first_paged(paged) is not units[0]:
        return None
    ctx = KernelContext(plan, units)
    if single_kernel(ctx):
        return StagedBinding(plan, paged, objects)
    if plan.direction is Direction.D2H and not plan.tight:
        return None  # the unbound path's per-tensor gather into a permuted view
    return UnitsBinding(plan, paged, objects)
