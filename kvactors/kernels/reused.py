"""Kernels of reused plans, specialised once per plan.

Theory of operation. A plan the plan cache matched runs on operands whose every metadata fact
(pointer, offset, shape, stride, dtype, device, structure) equals the validated one, so
everything a kernel derives from the plan and the operands' metadata is the same on every
call: which one-call path applies, the geometry of its views, its index tensors.
:func:`reused_kernel` decides all of it on the plan's first run and keeps, in the plan's
memo, a closure that makes only the torch calls of that path. A call then reads no plan
attribute and builds no view it does not pass to torch: after the previous call's copy has
evicted them from the CPU caches, every Python object touched costs a cache miss, and on a
small model those misses, not the copy, are what separates a transfer from one torch call.

The one-call paths are :mod:`kvactors.kernels.fast`'s: the stacked gather (one
``index_select`` per object over the stacked view permuted into its physical order) and the
rows path (one ``index_select`` or one numpy assignment of 2-D integer rows per object
between a rows view of the stacked memory and the chunk, where the block planes are tight).
A gather takes the stacked path first below 8 MiB and the rows path first from there. With
the compiled hot path (:mod:`kvactors.hotpath`) the stacked gather and the rows scatter run
compiled, and layouts without rows (HND) copy run by run both ways (one ``memcpy`` per
contiguous run: against torch's strided ``index_select``, a fresh-ids small-model HND gather
went from 1.10-1.27x to 0.98x of the single torch call, 4 callers from 1.19-1.50x to 1.00x).
Anything else (device plans, partial segments, separately allocated layers) runs
:func:`~kvactors.kernels.fast.run_fast` with the plan's memo.

Plans of the same operands and request but other block ids share a second dict (``shared``,
the plan cache's geometry memo). Which path runs and the geometry of its views do not depend
on the block ids, so the first plan of a geometry leaves there a *binder*: a function of a
plan that builds only that plan's index tensors and its kernel. A plan of new ids (most of
LMCache's calls) is bound at once, without deciding anything again. A binder keeps no
operand: the kernel is given them on every call.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Any

import torch

from kvactors import hotpath
from kvactors.kernels._views import raw
from kvactors.kernels.fast import _rows_steps, _stacked_geometry, run_fast
from kvactors.layouts import Direction

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.plans import RowGeometry, TransferPlan

__all__ = ("index_tensor", "reused_kernel")

_KEY = "reused_kernel"
_BIND = "reused_binder"

_ROWS_FIRST_BYTES = 8 << 20


def reused_kernel(
    plan: TransferPlan,
    paged: Any,
    objects: Sequence[torch.Tensor],
    memo: dict[Any, Any],
    shared: dict[Any, Any] | None = None,
    *,
    inference: bool = False,
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    """The kernel ``kernel(paged, objects)`` of a plan the plan cache matched to these
    operands (``memo`` is the plan's: the kernel is built on its first call and kept;
    ``shared`` is kept by every plan of these operands and request but other block ids: the
    facts that do not depend on the ids are computed once for all of them).

    ``inference``: an operand is an inference tensor (made under ``torch.inference_mode``),
    which torch writes only in inference mode; the kernel then runs in it."""
    kernel: Callable[[Any, Sequence[torch.Tensor]], None] | None = memo.get(_KEY)
    if kernel is None:
        bind = None if shared is None else shared.get(_BIND)
        if bind is not None:  # a plan of other ids on a geometry specialised before
            kernel = bind(plan)
        else:
            kernel = _specialise(plan, paged, objects, memo, {} if shared is None else shared)
        if inference:
            kernel = _in_inference_mode(kernel)
        memo[_KEY] = kernel
    return kernel


def _in_inference_mode(
    kernel: Callable[[Any, Sequence[torch.Tensor]], None],
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    def run(paged: Any, objects: Sequence[torch.Tensor]) -> None:
        with torch.inference_mode():
            kernel(paged, objects)

    return run


def index_tensor(ids: Sequence[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``ids``: built over an ``array`` buffer (the tensor keeps it),
    about a third of ``torch.tensor(ids)``'s cost (8 us against 22 us on evicted caches)."""
    if not ids:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64)


def _first(paged: Any) -> torch.Tensor:
    """The first paged tensor of a matched structure: one tensor, a list of layers, or K/V
    lists (nested or flat)."""
    if isinstance(paged, torch.Tensor):
        return paged
    first = paged[0]
    return first if isinstance(first, torch.Tensor) else first[0]  # type: ignore[no-any-return]


def _specialise(
    plan: TransferPlan,
    paged: Any,
    objects: Sequence[torch.Tensor],
    memo: dict[Any, Any],
    shared: dict[Any, Any],
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    if plan.on_host and plan.segments:
        unit0 = _first(paged)
        # A small gather takes the stacked path first (one torch call less than the rows
        # path's view plus index_select, at the same copy speed); from a few MiB on, the rows
        # path's one memcpy per block plane copies faster (32 MiB: 0.92x of the stacked time).
        rows_first = plan.rows is not None and plan.nbytes >= _ROWS_FIRST_BYTES
        if plan.direction is Direction.D2H and plan.stacked is not None and not rows_first:
            kernel = _stacked(plan, unit0, objects, shared)
            if kernel is not None:
                return kernel
        if plan.rows is not None:
            steps = _rows_steps(plan)
            if steps:
                return _rows(plan, steps, unit0, objects, shared)
        if plan.direction is Direction.D2H and plan.stacked is not None and rows_first:
            kernel = _stacked(plan, unit0, objects, shared)
            if kernel is not None:
                return kernel
        if plan.direction is Direction.H2D and plan.stacked is not None:
            kernel = _stacked(plan, unit0, objects, shared)  # compiled only (else numpy's)
            if kernel is not None:
                return kernel

    def general(paged: Any, objects: Sequence[torch.Tensor]) -> None:
        run_fast(plan, paged, objects, memo=memo, checked=True)

    return general


def _compiled(unit0: torch.Tensor, objects: Sequence[torch.Tensor]) -> hotpath.Hotpath | None:
    """The compiled hot path if it is loaded and every operand is a plain tensor (a subclass's
    Python methods may answer otherwise than its ``TensorImpl``, which the extension reads)."""
    native = hotpath.load()
    if native is None or type(unit0) is not torch.Tensor:
        return None
    return native if all(type(o) is torch.Tensor for o in objects) else None


def _stacked(
    plan: TransferPlan, unit0: torch.Tensor, objects: Sequence[torch.Tensor], shared: dict[Any, Any]
) -> Callable[[Any, Sequence[torch.Tensor]], None] | None:
    native = _compiled(unit0, objects)
    scatter = plan.direction is Direction.H2D
    if scatter and native is None:
        return None  # the general kernel's numpy scatter
    layout = shared.get("stacked")
    if layout is None:  # the views' geometry, the same for every block id and chunk buffer
        geo = _stacked_geometry(plan, unit0, objects)
        # A chunk view's storage offset counted from its chunk's: other buffers of the same
        # layout (the plan cache shares this memo between them) sit at other offsets.
        layout = shared["stacked"] = (
            (
                geo[0],
                geo[1],
                tuple(
                    (obj, (size, stride, offset - objects[obj].storage_offset()))
                    for obj, _, (size, stride, offset) in geo[2]
                ),
            )
            if geo
            else ()
        )
    if not layout:
        return None
    src_geo, dim, outs = layout
    ranges = tuple((seg.start, seg.stop) for seg in plan.segments)
    bind: Callable[[TransferPlan], Callable[[Any, Sequence[torch.Tensor]], None]]
    if native is not None:  # the same calls, compiled (kvactors/_compiled/hotpath.cpp)
        size, stride, offset = src_geo
        # Run by run, the runs as long as both sides allow (a whole block plane on NHD, MLA
        # and K/V lists): a few us under index_select's time on the small model's chunks.
        unbound = native.StackedRuns(size, stride, offset, dim, outs, not scatter)
        if not unbound.usable:  # no contiguous run: numpy's scatter, torch's gather
            if scatter:
                return None
            unbound = native.StackedGather(size, stride, offset, dim, outs)
        # The ranges checked once; each plan of new ids is then one plain C call.
        bind_ids = unbound.binder(ranges)

        def bind(p: TransferPlan) -> Callable[[Any, Sequence[torch.Tensor]], None]:
            bound: Callable[[Any, Sequence[torch.Tensor]], None] = bind_ids(p.request.block_ids)
            return bound

    else:

        def bind(p: TransferPlan) -> Callable[[Any, Sequence[torch.Tensor]], None]:
            ids = p.request.block_ids
            steps = tuple(
                (obj, index_tensor(ids[start:stop]), out)
                for (obj, out), (start, stop) in zip(outs, ranges, strict=True)
            )
            return _stacked_kernel(src_geo, dim, steps)

    shared[_BIND] = bind
    return bind(plan)


def _rows(
    plan: TransferPlan,
    steps: tuple[tuple[int, torch.Tensor, Any], ...],
    unit0: torch.Tensor,
    objects: Sequence[torch.Tensor],
    shared: dict[Any, Any],
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    g, direction = plan.rows, plan.direction
    assert g is not None
    # Same dtype on both sides (validated); one whose index_select is missing goes raw.
    as_raw = any(objects[obj].dtype is not unit0.dtype for obj, _, _ in steps)
    native = _compiled(unit0, objects)
    bind: Callable[[TransferPlan], Callable[[Any, Sequence[torch.Tensor]], None]]
    if native is not None and direction is Direction.H2D:  # compiled, GIL dropped
        unbound = native.RowsScatter(g.nrows, g.piece, g.row_stride, g.storage_offset)

        def bind(p: TransferPlan) -> Callable[[Any, Sequence[torch.Tensor]], None]:
            bound: Callable[[Any, Sequence[torch.Tensor]], None] = unbound.bind(
                tuple((obj, idx) for obj, idx, _ in _rows_steps(p))
            )
            return bound

    else:

        def bind(p: TransferPlan) -> Callable[[Any, Sequence[torch.Tensor]], None]:
            return _rows_kernel(g, direction, _rows_steps(p), as_raw)

    shared[_BIND] = bind
    return bind(plan)


def _rows_kernel(
    g: RowGeometry,
    direction: Direction,
    steps: tuple[tuple[int, torch.Tensor, Any], ...],
    as_raw: bool,
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    size, stride, offset = (g.nrows, g.piece), (g.row_stride, 1), g.storage_offset
    if direction is Direction.D2H:
        outs = tuple((obj, idx, (idx.numel(), -1)) for obj, idx, _ in steps)

        def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
            u0 = _first(paged)
            rows = (raw(u0) if as_raw else u0).as_strided(size, stride, offset)
            for obj, idx, view in outs:
                out = objs[obj]
                torch.index_select(rows, 0, idx, out=(raw(out) if as_raw else out).view(view))

        return gather
    ins = tuple((obj, idx_np, (idx.numel(), -1)) for obj, idx, idx_np in steps)

    def scatter(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        # Rows of integers, not opaque void items: numpy's fancy assignment of void items
        # holds the GIL (4 threads scattering at once ran slower than one), of 2-D integer
        # rows it copies each row with the GIL released, as fast.
        rows_np = raw(_first(paged)).as_strided(size, stride, offset).numpy()
        for obj, idx_np, view in ins:
            rows_np[idx_np] = raw(objs[obj]).view(view).numpy()

    return scatter


def _stacked_kernel(
    src_geo: tuple[Any, ...], dim: int, steps: tuple[tuple[int, torch.Tensor, Any], ...]
) -> Callable[[Any, Sequence[torch.Tensor]], None]:
    def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        src = _first(paged).as_strided(*src_geo)
        for obj, ids, (size, stride, offset) in steps:
            out = objs[obj]
            view = out.as_strided(size, stride, out.storage_offset() + offset)
            torch.index_select(src, dim, ids, out=view)

    return gather
