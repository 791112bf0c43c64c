"""Host gather when the layers are separate allocations: one ``index_select`` per object and
paged tensor, with every view's geometry decided once per plan cache entry.

Theory of operation. Without a stacked view a gather cannot cover the layers in one call,
but each paged tensor still can: its canonical ``[P', B, S, H, D]`` view permuted into its
physical order (torch's ``index_select`` is only fast on such a source, performance.md
section 2), the object's slots of that layer permuted the same way, the block axis selected.
That is the per-tensor path of :mod:`kvactors.kernels._moves`; here the permutations, the
output views' geometry (relative to their chunk's storage offset, so other chunk buffers of
the same layout share it) and the index tensors are built when the plan is bound, and a call
makes one ``as_strided`` per output view and the ``index_select`` calls; the paged tensors'
views are kept while calls pass those very tensors (weakly: :class:`WeakHold`). An engine's
small chunks (two blocks of a few layers) then pay for the copies, not for building views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.plans import paged_units
from kvactors.kernels._views import (
    WeakHold,
    canonical_unit,
    index_tensor,
    object_view,
    physical_order,
    raw,
    unit_planes,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvactors.core.plan_cache import Binder, Kernel
    from kvactors.core.plans import TransferPlan

__all__ = ("units_gather_binder",)

_SELECTABLE = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
     torch.int16, torch.int32, torch.int64, torch.bool}
)  # fmt: skip
_Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, relative offset


def units_gather_binder(
    plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]
) -> Binder | None:
    """The binder of a host gather (D2H) per paged tensor, or ``None`` when an object's
    dtype differs from the paged tensors' (the per-segment paths move it as raw integers)."""
    units = paged_units(plan.spec, paged)
    if any(objects[seg.obj].dtype is not units[0].dtype for seg in plan.segments):
        return None
    shape = plan.request.shape
    srcs: list[_Geometry] = []
    dims: list[int] = []
    orders: list[list[int]] = []
    for t in units:
        cu = canonical_unit(plan.spec, t)  # [P', B, S, H, D]
        order = physical_order(cu)
        src, dim = cu.permute(order), order.index(1)
        # A non-contiguous source selected on dim 1 is copied whole first (as in
        # fast._stacked_geometry): a leading size-1 axis moves the block axis to 2.
        lead = dim == 1 and not src.is_contiguous()
        if lead:
            src, dim = src.unsqueeze(0), 2
        srcs.append(
            (tuple(src.shape), src.stride(), int(src.storage_offset() - t.storage_offset()))
        )
        dims.append(dim)
        orders.append([0, *[i + 1 for i in order]] if lead else order)
    outs: list[tuple[int, int, int, int, _Geometry]] = []
    for seg in plan.segments:
        obj = objects[seg.obj]
        ov = object_view(plan.spec, obj, shape.nl, shape.nh, shape.hs, shape.bs)
        for u in range(len(units)):
            layer, planes = unit_planes(plan.spec, plan.request.shape.nl, u)
            out = ov[planes.start : planes.stop, layer]  # [P', J, S, H, D]
            out = out.narrow(1, seg.slot0, seg.count)
            if len(orders[u]) > out.dim():
                out = out.unsqueeze(0)
            out = out.permute(orders[u])
            rel = int(out.storage_offset() - obj.storage_offset())
            outs.append((seg.obj, u, seg.start, seg.stop, (tuple(out.shape), out.stride(), rel)))
    spec = plan.spec
    # Same-width integers where torch's index_select may lack the dtype (fp8): same bytes.
    as_raw = units[0].dtype not in _SELECTABLE
    kept = WeakHold()  # the views of the latest call's paged tensors

    def bind(p: TransferPlan) -> Kernel:
        ids = p.request.block_ids
        index: dict[tuple[int, int], torch.Tensor] = {}
        steps = []
        for obj, u, start, stop, geo in outs:
            idx = index.get((start, stop))
            if idx is None:
                idx = index[start, stop] = index_tensor(ids[start:stop])
            steps.append((obj, u, dims[u], idx, geo))
        return _kernel(spec, srcs, tuple(steps), as_raw, kept)

    return bind


def _kernel(
    spec: Any,
    srcs: list[_Geometry],
    steps: tuple[tuple[int, int, int, torch.Tensor, _Geometry], ...],
    as_raw: bool,
    kept: WeakHold,
) -> Kernel:
    def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        units = paged_units(spec, paged)
        # The paged tensors' views are kept while calls pass those very tensors.
        views: list[torch.Tensor] | None = kept.kept(units)
        if views is None:
            views = [
                (raw(t) if as_raw else t).as_strided(size, stride, t.storage_offset() + off)
                for t, (size, stride, off) in zip(units, srcs, strict=True)
            ]
            kept.hold(units, views)
        for obj, u, dim, idx, (size, stride, off) in steps:
            out = raw(objs[obj]) if as_raw else objs[obj]
            view = out.as_strided(size, stride, out.storage_offset() + off)
            torch.index_select(views[u], dim, idx, out=view)

    return gather
