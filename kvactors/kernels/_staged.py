"""The staged device path's moves: one kernel and one host<->device copy per segment.

Torch cannot index across devices, so a segment moves through a contiguous device staging
buffer ``[P, L, n, S, H, D]``: a gather is one ``index_select`` into it and one copy to the
host chunk; a scatter the mirror image. This needs one view over all paged tensors (rows or
stacked); other plans take :mod:`kvactors.kernels._moves` per tensor. Index tensors and
staging buffers come from the stream's :class:`~kvactors.kernels._context.ScratchCache`, safe
to share because everything is issued in order on the caller's current stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.core.layouts import Direction
from kvactors.kernels._views import physical_order

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.core.plans import Segment
    from kvactors.kernels._context import KernelContext, ScratchCache

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
