"""One segment's gather (paged -> chunk) and scatter (chunk -> paged), fastest path first.

Each function moves one segment's blocks between paged memory and a chunk-shaped target (the
host chunk, or a device staging buffer). They serve what the one-call host paths of
:mod:`kvactors.kernels.fast`, ``_units`` and ``_planes`` do not: the staged device path,
scatters without numpy, and host plans no binder took. Gather paths, in order of preference:
``rows`` (one stacked allocation, block planes contiguous: one ``index_select``), ``planes``
(separate layers: one call per layer and plane), ``stacked`` (one strided view over all layers,
HND included: one ``index_select`` with the transpose fused) and ``units`` (one call per paged
tensor). Nothing chunk-sized is allocated: only index tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.kernels._views import block_runs, physical_order

if TYPE_CHECKING:
    from kvactors.core.plans import Segment
    from kvactors.kernels._context import KernelContext

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


def gather_segment(ctx: KernelContext, seg: Segment, target: torch.Tensor) -> None:
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
