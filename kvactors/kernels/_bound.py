"""Bound staged kernels: the staged path of a device plan the plan cache matched, decided once.

:func:`kvactors.kernels._staged.staged_segment` builds a call's views from its plan on every
call: the paged view, each segment's staging shape and host view, the index kind. Those
depend on the cache entry alone (the key holds every operand fact they read), so a
:class:`StagedBinding` keeps them as geometry, decided on the entry's first run. A call then
reads its block ids' index tensors from the stream's :class:`ScratchCache` (one upload for new
ids) and, per segment, runs one kernel and one host<->device copy, exactly the torch calls of
the unbound path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import Direction
from kvactors.core.plans import paged_units
from kvactors.kernels._context import KernelContext, index_values
from kvactors.kernels._staged import single_kernel
from kvactors.kernels._views import first_paged, physical_order, raw

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from kvactors.core.plans import TransferPlan
    from kvactors.kernels._context import ScratchCache

__all__ = ("StagedBinding", "staged_binding")

_Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # as_strided's size, stride, offset


def _geometry(t: torch.Tensor) -> _Geometry:
    return tuple(t.shape), t.stride(), int(t.storage_offset())


class _Segment:
    """One segment's part of a binding: its chunk, staging buffer, views and index."""

    __slots__ = ("host", "obj", "staging", "start", "stop", "view")

    def __init__(
        self,
        obj: int,
        staging: tuple[int, ...],
        view: _Geometry,
        host: _Geometry,
        start: int,
        stop: int,
    ) -> None:
        self.obj = obj  # the chunk's position in ``objects``
        self.staging = staging  # the staging buffer's shape
        self.view = view  # the kernel's view of the staging buffer
        self.host = host  # the chunk's view: offset relative to the chunk's own
        self.start, self.stop = start, stop  # its block ids' slice of the request's


class StagedBinding:
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
            segments.append(_Segment(seg.obj, staging, view, host, seg.start, seg.stop))
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
        source = first.view(dtype).as_strided(*self.source)
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
        for k, (seg, idx, staging) in enumerate(zip(self.segments, indices, buffers, strict=True)):
            view = staging.as_strided(*seg.view)
            obj = objects[seg.obj].view(dtype)
            size, stride, offset = seg.host
            host = obj.as_strided(size, stride, obj.storage_offset() + offset)
            if flags is None:
                blocks = must_block(host, staging) if d2h else must_block(staging, host)
                decided.append(not blocks)
                non_blocking = not blocks
            else:
                non_blocking = flags[k]
            if d2h:
                torch.index_select(source, dim, idx, out=view)
                host.copy_(staging, non_blocking=non_blocking)
            else:
                staging.copy_(host, non_blocking=non_blocking)
                source.index_copy_(dim, idx, view)
        if flags is None:
            self.non_blocking = tuple(decided)


def staged_binding(
    plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]
) -> StagedBinding | None:
    """The binding of a device plan moved one kernel per segment (a rows or stacked view),
    or ``None`` (the unbound path serves it)."""
    if plan.on_host or not plan.segments:
        return None
    units = paged_units(plan.spec, paged)
    if first_paged(paged) is not units[0]:
        return None
    if not single_kernel(KernelContext(plan, units)):
        return None
    return StagedBinding(plan, paged, objects)
