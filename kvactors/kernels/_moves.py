"""One segment's gather (paged -> chunk) and scatter (chunk -> paged), fastest path first.

Paths, in order of preference: ``rows`` (one stacked allocation, block planes contiguous:
one ``index_select`` or numpy row assignment), ``planes`` (contiguous planes, separate layers:
one call per layer and plane), ``stacked`` (one strided view over all layers, HND included:
one ``index_select``, or one numpy assignment for a host scatter) and ``units`` (one call per
paged tensor). Nothing chunk-sized is allocated: only index tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.kernels._views import block_runs, physical_order, void_view

if TYPE_CHECKING:
    from kvactors.kernels._context import KernelContext
    from kvactors.plans import Segment

__all__ = ("gather_segment", "numpy_usable", "scatter_segment")

_NUMPY: bool | None = None
_CPU = torch.device("cpu")


def numpy_usable() -> bool:
    """Whether torch tensors can be viewed as numpy arrays here (numpy installed)."""
    global _NUMPY
    if _NUMPY is None:
        try:
            torch.zeros(1).numpy()
            _NUMPY = True
        except (ImportError, RuntimeError):
            _NUMPY = False
    return _NUMPY


def gather_segment(
    ctx: KernelContext, seg: Segment, target: torch.Tensor, *, use_numpy: bool
) -> None:
    """Copy the segment's blocks from the paged memory into ``target`` (raw, chunk-shaped)."""
    n, j0 = seg.count, seg.slot0
    if ctx.rows is not None:
        idx = ctx.row_index(seg)
        if n == ctx.bpo:
            torch.index_select(ctx.rows, 0, idx.view(-1), out=target.view(idx.numel(), -1))
        else:
            tv = ctx.plane_rows(target)
            for i in range(idx.size(0)):
                torch.index_select(ctx.rows, 0, idx[i], out=tv[i, j0 : j0 + n])
        return
    if ctx.plan.tight:
        tv = ctx.plane_rows(target)[:, j0 : j0 + n]
        if use_numpy and _planes_take(ctx, seg, tv):
            return
        ids = ctx.ids(seg)
        for plane, i in ctx.plane_views():
            torch.index_select(plane, 0, ids, out=tv[i])
        return
    ids = ctx.ids(seg)
    ov = ctx.target_view(target).permute(1, 0, 2, 3, 4, 5)[:, :, j0 : j0 + n]
    if ctx.stacked is not None:
        order = physical_order(ctx.stacked)
        src = ctx.stacked.permute(order)
        torch.index_select(src, order.index(2), ids, out=ov.permute(order))
        return
    for cu, layer, planes in ctx.unit_views():
        order = physical_order(cu)
        out = ov[layer, planes.start : planes.stop].permute(order)
        torch.index_select(cu.permute(order), order.index(1), ids, out=out)


def scatter_segment(
    ctx: KernelContext, seg: Segment, source: torch.Tensor, *, use_numpy: bool
) -> None:
    """Copy the segment's rows of ``source`` (raw, chunk-shaped) into the paged blocks."""
    block_ids = ctx.plan.request.block_ids[seg.start : seg.stop]
    n, j0 = seg.count, seg.slot0
    if use_numpy and ctx.rows is not None:
        rows = void_view(ctx.rows)
        assert rows is not None  # rows are unit-stride by construction
        idx = ctx.row_index(seg, _CPU)
        if n == ctx.bpo:
            rows[idx.view(-1).numpy()] = void_view(source.view(idx.numel(), -1))
        else:
            sv = ctx.plane_rows(source)
            for i in range(idx.size(0)):
                rows[idx[i].numpy()] = void_view(sv[i, j0 : j0 + n])
        return
    if use_numpy and _stacked_scatter(ctx, seg, source):
        return
    if use_numpy and ctx.plan.tight and ctx.stacked is None:
        sv = ctx.plane_rows(source)[:, j0 : j0 + n]
        ids_np = ctx.ids(seg, _CPU).numpy()
        voids = ctx.plane_voids()
        if voids is not None:
            sv_np = void_view(sv)
            assert sv_np is not None  # chunk slots are contiguous
            for plane_np, i in voids:
                plane_np[ids_np] = sv_np[i]
        else:
            for plane, i in ctx.plane_views():
                plane.numpy()[ids_np] = sv[i].numpy()
        return
    ov = ctx.target_view(source).permute(1, 0, 2, 3, 4, 5)[:, :, j0 : j0 + n]
    if ctx.stacked is not None:
        for k, b, r in block_runs(block_ids):
            ctx.stacked.narrow(2, b, r).copy_(ov.narrow(2, k, r))
        return
    for cu, layer, planes in ctx.unit_views():
        src = ov[layer, planes.start : planes.stop]
        if use_numpy:
            ids_np = ctx.ids(seg, _CPU).numpy()
            cu.numpy()[:, ids_np] = src.numpy()
        elif cu.device.type != "cpu":
            cu.index_copy_(1, ctx.ids(seg), src)
        else:
            for k, b, r in block_runs(block_ids):
                cu.narrow(1, b, r).copy_(src.narrow(1, k, r))


def _planes_take(ctx: KernelContext, seg: Segment, tv: torch.Tensor) -> bool:
    """The planes host gather through numpy (module docstring): per (paged tensor, plane) one
    ``take`` of whole block planes into the chunk's slots ``tv[i]`` (contiguous). ``False``
    (nothing moved) when a plane is not contiguous."""
    voids = ctx.plane_voids()
    if voids is None:
        return False
    ids_np = ctx.ids(seg, _CPU).numpy()
    out = void_view(tv)
    assert out is not None  # chunk slots are contiguous
    for plane_np, i in voids:
        # mode="clip": the plan validated every id; the default "raise" buffers the output.
        plane_np.take(ids_np, axis=0, out=out[i], mode="clip")
    return True


def _stacked_scatter(ctx: KernelContext, seg: Segment, chunk: torch.Tensor) -> bool:
    """The stacked host scatter through numpy (module docstring); ``False`` when it does not
    apply (no stacked view, or an ``HS`` axis that is not contiguous), nothing moved then."""
    if ctx.stacked is None:
        return False
    paged = ctx.stacked_void()
    if paged is None:
        return False
    ov = ctx.target_view(chunk)[:, :, seg.slot0 : seg.slot0 + seg.count]
    obj = void_view(ov)  # [P, L, n, S, H]
    assert obj is not None  # chunks are contiguous
    # Advanced indices on the paged axes (L, P, B), broadcast to the chunk's (P, L, n) order.
    layers = torch.arange(ctx.nl).view(1, -1, 1).numpy()
    planes = torch.arange(ctx.planes).view(-1, 1, 1).numpy()
    blocks = ctx.ids(seg, _CPU).view(1, 1, -1).numpy()
    paged[layers, planes, blocks] = obj
    return True
