"""The staged device path's moves: one kernel and one host<->device copy per segment.

Theory of operation. On an accelerator torch cannot index across devices, so a segment
(the blocks of one host chunk) moves in two steps through a device staging buffer shaped
like the segment's part of the chunk, ``[P, L, n, S, H, D]`` and contiguous:

* gather: ONE ``index_select`` from the paged memory into the staging buffer, then ONE
  copy staging -> host chunk (asynchronous when the chunk region is contiguous, which it
  is for every full segment);
* scatter: ONE copy host chunk -> staging, then ONE ``index_copy_`` from the staging buffer
  into the paged memory.

This holds when the plan found one view over all paged tensors: the rows view (block
planes are contiguous token-major runs: one row per block plane, index ``[P*L, n]`` row
numbers) or the stacked ``[L, P, B, S, H, D]`` view (any strides, HND included: the kernel
runs on both sides permuted into the paged memory's physical order, which fuses the
transpose). Other plans (separately allocated layers) take the per-tensor paths of
:mod:`kvactors.kernels._moves`, one kernel per paged tensor.

The index tensors (block ids, row numbers) live on the device, uploaded once per distinct
content and kept in the :class:`~kvactors.kernels._context.ScratchCache` of the stream
(``KernelContext.ids`` / ``row_index`` read it), so a repeated request uploads nothing and
never waits for the device. The staging buffers come from the same cache. Everything is
issued in order on the caller's current stream, which is what makes sharing them safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.kernels._views import physical_order
from kvactors.layouts import Direction

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.kernels._context import KernelContext, ScratchCache
    from kvactors.plans import Segment

__all__ = ("single_kernel", "staged_segment")


def single_kernel(ctx: KernelContext) -> bool:
    """Whether the plan moves each segment with one kernel (a rows or stacked view)."""
    return ctx.rows is not None or ctx.stacked is not None


def staged_segment(
    ctx: KernelContext,
    seg: Segment,
    obj: torch.Tensor,
    copy: Callable[[torch.Tensor, torch.Tensor], None],
    scratch: ScratchCache,
) -> None:
    """Move one segment between the paged memory and the (raw) host chunk ``obj``.

    Only for :func:`single_kernel` plans.
    """
    n = seg.count
    shape = ctx.plan.request.shape
    heads = 1 if ctx.plan.spec.is_mla else shape.nh
    staging = scratch.get(ctx.device, (ctx.planes, ctx.nl, n, shape.bs, heads, shape.hs), obj.dtype)
    if n == ctx.bpo:
        host = obj.view(staging.shape)  # the whole chunk: contiguous, one plain DMA
    else:
        host = ctx.target_view(obj)[:, :, seg.slot0 : seg.slot0 + n]
    if ctx.plan.direction is Direction.D2H:
        _gather(ctx, seg, staging)
        copy(host, staging)
    else:
        copy(staging, host)
        _scatter(ctx, seg, staging)


def _gather(ctx: KernelContext, seg: Segment, staging: torch.Tensor) -> None:
    if ctx.rows is not None:
        idx = ctx.row_index(seg)
        torch.index_select(ctx.rows, 0, idx.view(-1), out=staging.view(idx.numel(), -1))
        return
    stacked = ctx.stacked
    assert stacked is not None
    order = physical_order(stacked)
    ov = staging.permute(1, 0, 2, 3, 4, 5)  # [L, P, n, S, H, D], like the stacked view
    torch.index_select(stacked.permute(order), order.index(2), ctx.ids(seg), out=ov.permute(order))


def _scatter(ctx: KernelContext, seg: Segment, staging: torch.Tensor) -> None:
    if ctx.rows is not None:
        idx = ctx.row_index(seg)
        ctx.rows.index_copy_(0, idx.view(-1), staging.view(idx.numel(), -1))
        return
    stacked = ctx.stacked
    assert stacked is not None
    order = physical_order(stacked)
    ov = staging.permute(1, 0, 2, 3, 4, 5)
    stacked.permute(order).index_copy_(order.index(2), ctx.ids(seg), ov.permute(order))
