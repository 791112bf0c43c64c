"""One segment's gather (paged -> chunk) and scatter (chunk -> paged), fastest path first.

Theory of operation. Each function moves the blocks of one segment between the paged memory
and a chunk-shaped target (the host chunk itself, or a device staging buffer on the staged
path). They serve what the one-call host paths of :mod:`kvactors.kernels.fast`,
:mod:`kvactors.kernels._units` and :mod:`kvactors.kernels._planes` do not: the staged device
path, scatters without numpy or with an ``HS`` axis that is not contiguous, and a host plan
no binder took. The gather paths, in order of preference (measured in performance.md and
bench_transfer):

* rows: the paged memory is one stacked allocation and every block plane is one contiguous
  token-major run: ONE ``index_select`` over a ``[rows, BS*NH*HS]`` view whose output is the
  contiguous chunk itself, which torch serves with one ``memcpy`` per block plane.
* planes: block planes are contiguous but the layers are separate allocations: the same, one
  call per (layer, plane).
* stacked: one strided view covers all layers but blocks are not token-major (HND): one
  ``index_select`` on the view in physical order, writing a permuted view of the chunk (the
  transpose is fused; torch copies ``HS`` runs, 0.9x of a C ``memcpy`` loop over the same
  runs).
* units: anything else, one call per paged tensor (physical order again).

A scatter here is one ``copy_`` per run of consecutive block ids over the stacked view, else
per paged tensor (numpy's fancy assignment on the host, ``index_copy_`` on a device).

No path allocates anything chunk-sized: outputs are views of the target, inputs views of the
paged memory; the only temporaries are index tensors of at most ``P*NL*bpo`` integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.kernels._views import block_runs, physical_order

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
