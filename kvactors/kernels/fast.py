"""The fast transfer kernels: few large torch calls per chunk, nothing chunk-sized allocated.

:func:`run_fast` executes a validated plan one segment (object) at a time. Host path (paged
memory on the CPU): blocks move straight between paged memory and chunk, one call per object
where the plan allows (stacked or rows view), else :mod:`kvactors.kernels._moves`. Staged path
(paged memory on an accelerator, or ``staged=True``): a device staging buffer and one
host<->device copy per segment (:mod:`kvactors.kernels._staged`); its buffers come from one
stream's :class:`ScratchCache`. A plan the plan cache matched runs :func:`reused_kernel`, whose
path and view geometry are decided once per cache entry (:class:`KernelMemo`).
"""

from __future__ import annotations

import array
import itertools
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import Direction
from kvactors.core.plans import paged_units
from kvactors.errors import TransferValidationError
from kvactors.kernels._context import KernelContext, ScratchCache
from kvactors.kernels._moves import gather_segment, numpy_usable, scatter_segment
from kvactors.kernels._planes import planes_scatter_binder
from kvactors.kernels._staged import single_kernel, staged_segment
from kvactors.kernels._units import units_gather_binder
from kvactors.kernels._views import WeakHold, first_paged, index_tensor, object_view, raw

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.core.plan_cache import Binder, Kernel, KernelMemo
    from kvactors.core.plans import RowGeometry, TransferPlan

__all__ = ("ScratchCache", "index_tensor", "reused_kernel", "run_fast")

_ROWS_FIRST_BYTES = 8 << 20  # a gather this big takes the rows path before the stacked one
_Tensor = torch.Tensor
_I64 = torch.int64


_local = threading.local()


def _thread_scratch() -> ScratchCache:
    cache: ScratchCache | None = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = ScratchCache()
    return cache


def _default_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def run_fast(
    plan: TransferPlan,
    paged: object,
    objects: Sequence[torch.Tensor],
    *,
    copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    scratch: ScratchCache | None = None,
    staged: bool | None = None,
    checked: bool = False,
    keep: list[torch.Tensor] | None = None,
    use_numpy: bool | None = None,
) -> None:
    """Execute a validated plan with the fast kernels.

    Args:
        plan: A plan from :func:`kvactors.core.plans.plan_transfer`.
        paged: The paged operand the plan was made for.
        objects: The host chunks the plan was made for.
        copy: Host<->device copy policy ``copy(dst, src)`` for the staged path (default
            ``dst.copy_(src, non_blocking=True)``).
        scratch: Staging buffer cache for the staged path (default: one per thread).
        staged: Force (``True``) or forbid (``False``) the staged path; ``None`` stages
            exactly when the paged tensors are not on the CPU.
        checked: The caller already proved these are the planned operands (the runtime's
            plan cache matched their metadata), so the pointer check is skipped.
        keep: The staged path uploads new block ids without waiting, from pinned host
            tensors it appends here (:meth:`ScratchCache.prefetch`): the caller keeps the
            list alive until the stream ran the copies, and calls the scratch cache's
            ``invalidate`` when work on the stream failed. Without it new ids are uploaded
            synchronously.
        use_numpy: Whether the host paths may view tensors as numpy arrays; ``None``
            (default): where numpy is installed (:func:`numpy_usable`). Without it a host
            gather builds its row index with torch and a host scatter takes the per-segment
            torch path: the same bytes.

    Raises:
        TransferValidationError: The operands are not the ones the plan was made for, or
            ``staged=False`` was asked for device tensors.
    """
    units = paged_units(plan.spec, paged)
    objs = list(objects)
    if not checked and (
        tuple(t.data_ptr() for t in units) != plan.paged_ptrs
        or tuple(o.data_ptr() for o in objs) != plan.object_ptrs
    ):
        raise TransferValidationError("operands differ from the planned ones", field="plan")
    if not plan.segments:
        return
    use_staging = (not plan.on_host) if staged is None else staged
    if not use_staging and not plan.on_host:
        raise TransferValidationError("device tensors need the staged path", field="staged")
    if not use_staging:
        bind = _host_binder(plan, paged, objs, use_numpy, _ROWS_FIRST_BYTES)
        if bind is not None:
            bind(plan)(paged, objs)
            return
    _run_general(plan, units, objs, use_staging, copy, scratch, {}, keep, use_numpy)


def _run_general(
    plan: TransferPlan,
    units: list[torch.Tensor],
    objs: Sequence[torch.Tensor],
    use_staging: bool,
    copy: Callable[[torch.Tensor, torch.Tensor], None] | None,
    scratch: ScratchCache | None,
    indices: dict[tuple[str, int, int, str], torch.Tensor],
    keep: list[torch.Tensor] | None = None,
    use_numpy: bool | None = None,
) -> None:
    """The per-segment paths (host) or the staged path (device); ``indices`` keeps the plan's
    host index tensors between calls of the same plan; ``use_numpy`` as for :func:`run_fast`."""
    ctx = KernelContext(plan, units, indices)
    raw_objs = [raw(o) for o in objs]
    if not use_staging:
        d2h = plan.direction is Direction.D2H
        np_ok = numpy_usable() if use_numpy is None else use_numpy
        for seg in plan.segments:
            if d2h:
                gather_segment(ctx, seg, raw_objs[seg.obj])
            else:
                scatter_segment(ctx, seg, raw_objs[seg.obj], use_numpy=np_ok)
        return
    _run_staged(
        ctx,
        raw_objs,
        copy if copy is not None else _default_copy,
        scratch if scratch is not None else _thread_scratch(),
        keep,
    )


def reused_kernel(
    plan: TransferPlan,
    paged: Any,
    objects: Sequence[torch.Tensor],
    memo: KernelMemo,
    *,
    inference: bool = False,
    rows_first_bytes: int = _ROWS_FIRST_BYTES,
) -> Kernel:
    """The kernel ``kernel(paged, objects)`` of a host plan the plan cache matched to these
    operands; ``memo`` is the cache entry's (the path and its views' geometry are decided on
    its first plan and kept as a binder; a plan of the same ids as the last one reuses its
    kernel).

    ``inference``: an operand is an inference tensor (made under ``torch.inference_mode``),
    which torch writes only in inference mode; the kernel then runs in it.

    ``rows_first_bytes``: a full host gather over a stacked view of at least this many bytes
    whose block planes are rows takes the rows path before the stacked one (default: the
    size from which the rows path copies faster); read on the entry's first plan only."""
    ids = plan.request.block_ids
    last = memo.last
    if last is not None and last[0] == ids:
        return last[1]
    bind = memo.binder
    if bind is None:
        bind = _binder(plan, paged, objects, rows_first_bytes)
        if inference:
            bind = _in_inference_mode(bind)
        memo.binder = bind
    kernel = bind(plan)
    memo.last = (ids, kernel)
    return kernel


def _binder(
    plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor], rows_first_bytes: int
) -> Binder:
    if plan.on_host and plan.segments:
        bind = _host_binder(plan, paged, objects, None, rows_first_bytes)
        if bind is not None:
            return bind

    def general(p: TransferPlan) -> Kernel:
        indices: dict[tuple[str, int, int, str], torch.Tensor] = {}

        def kernel(paged: Any, objects: Sequence[torch.Tensor]) -> None:
            units = paged_units(p.spec, paged)
            if p.segments:
                _run_general(p, units, objects, not p.on_host, None, None, indices)

        return kernel

    return general


def _in_inference_mode(
    bind: Binder,
) -> Binder:
    def bind_inference(p: TransferPlan) -> Kernel:
        kernel = bind(p)

        def run(paged: Any, objects: Sequence[torch.Tensor]) -> None:
            with torch.inference_mode():
                kernel(paged, objects)

        return run

    return bind_inference


def _host_binder(
    plan: TransferPlan,
    paged: Any,
    objects: Sequence[torch.Tensor],
    use_numpy: bool | None,
    rows_first_bytes: int,
) -> Binder | None:
    """The binder of a host plan's one-call path, or ``None`` when none applies (a scatter
    without numpy, an ``HS`` axis that is not contiguous). A gather over a stacked view:
    a small one takes the stacked path first (one torch call less than the rows path's view
    plus index_select), one of ``rows_first_bytes`` or more the rows path first (one
    ``memcpy`` per block plane copies faster), one with a partial segment (a skipped
    prefix, a short last chunk) the stacked path; a gather without a stacked view takes one
    call per object and paged tensor (:mod:`kvactors.kernels._units`). A scatter takes the
    rows path (integer rows, the GIL released) where the block planes are tight and every
    segment full, else the block-plane rows of :mod:`kvactors.kernels._planes`.
    ``use_numpy`` as for :func:`run_fast`."""
    unit0 = first_paged(paged)
    bpo = plan.request.chunk_size // plan.request.shape.bs
    full = all(seg.count == bpo for seg in plan.segments)
    gather = plan.direction is Direction.D2H
    if not gather:
        if not (numpy_usable() if use_numpy is None else use_numpy):
            return None
        if full and plan.rows is not None:
            return _rows_binder(plan, unit0, objects, True)
        return planes_scatter_binder(plan, paged, objects)
    stacked = plan.stacked is not None
    if not stacked:
        return units_gather_binder(plan, paged, objects)
    if not full:
        return _stacked_binder(plan, unit0, objects)
    if not (plan.rows is not None and plan.nbytes >= rows_first_bytes):
        bind = _stacked_binder(plan, unit0, objects)
        if bind is not None:
            return bind
    if plan.rows is not None:
        return _rows_binder(plan, unit0, objects, use_numpy)
    return _stacked_binder(plan, unit0, objects)


def _rows_binder(
    plan: TransferPlan,
    unit0: torch.Tensor,
    objects: Sequence[torch.Tensor],
    use_numpy: bool | None,
) -> Binder:
    g, direction = plan.rows, plan.direction
    assert g is not None
    # Same dtype on both sides (validated); one whose index_select is missing goes raw.
    as_raw = any(objects[seg.obj].dtype is not unit0.dtype for seg in plan.segments)

    kept = WeakHold()  # the rows view of the latest first paged tensor (an array, scattering)
    if direction is Direction.D2H:

        def bind(p: TransferPlan) -> Kernel:
            return _rows_gather(g, _rows_steps(p, use_numpy), as_raw, kept)

    else:
        order = [seg.obj for seg in plan.segments]

        def bind(p: TransferPlan) -> Kernel:
            return _rows_scatter(g, order, _rows_array(p), kept)

    return bind


def _rows_gather(
    g: RowGeometry,
    steps: tuple[tuple[int, torch.Tensor, Any], ...],
    as_raw: bool,
    kept: WeakHold,
) -> Kernel:
    size, stride, offset = (g.nrows, g.piece), (g.row_stride, 1), g.storage_offset
    outs = tuple((obj, idx, (idx.numel(), -1)) for obj, idx, _ in steps)

    def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        u0 = paged if type(paged) is _Tensor else paged[0]
        if type(u0) is not _Tensor:
            u0 = first_paged(paged)
        held = kept.held
        if held is not None and held[0][0]() is u0:
            rows = held[1]
        else:
            rows = (raw(u0) if as_raw else u0).as_strided(size, stride, offset)
            kept.hold((u0,), rows)
        for obj, idx, view in outs:
            out = objs[obj]
            torch.index_select(rows, 0, idx, out=(raw(out) if as_raw else out).view(view))

    return gather


def _rows_scatter(g: RowGeometry, order: list[int], flat_np: Any, kept: WeakHold) -> Kernel:
    size, stride, offset = (g.nrows, g.piece), (g.row_stride, 1), g.storage_offset
    ins = tuple((o, idx_np, (idx_np.size, -1)) for o, idx_np in zip(order, flat_np, strict=True))

    def scatter(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        # Rows of integers, not opaque void items: numpy's fancy assignment of void items
        # holds the GIL, of 2-D integer rows it copies each row with the GIL released. The
        # pool's rows array is kept (no torch call per scatter but the chunk's integer view).
        u0 = paged if type(paged) is _Tensor else paged[0]
        if type(u0) is not _Tensor:
            u0 = first_paged(paged)
        held = kept.held
        if held is not None and held[0][0]() is u0:
            rows_np = held[1]
        else:
            rows_np = raw(u0).as_strided(size, stride, offset).numpy()
            kept.hold((u0,), rows_np)
        for obj, idx_np, view in ins:
            rows_np[idx_np] = raw(objs[obj]).numpy().reshape(view)

    return scatter


def _stacked_binder(
    plan: TransferPlan, unit0: torch.Tensor, objects: Sequence[torch.Tensor]
) -> Binder | None:
    """A gather plan with one stacked view, in ONE ``index_select`` per object: the stacked
    ``[L, P, B, S, H, D]`` view permuted into its physical order (torch's ``index_select``
    is only fast on such a source), the chunk's view permuted the same way, the block axis
    selected: exactly the single torch call of the same bytes. The views' geometry is kept
    (each chunk view's storage offset relative to its chunk's, so other chunk buffers of the
    same layout share it); the stacked view is kept while calls pass the same first paged
    tensor (weakly: :class:`WeakHold`), and each call makes one ``as_strided`` per chunk."""
    geo = _stacked_geometry(plan, unit0, objects)
    if geo is None:
        return None
    src_geo, dim, outs = geo
    segs = plan.segments
    ranges = tuple((seg.start, seg.stop) for seg in segs)
    first, stop = segs[0].start, segs[-1].stop
    counts = [seg.stop - seg.start for seg in segs]
    if all(b.start == a.stop for a, b in itertools.pairwise(segs)) and all(counts):
        # Abutting segments: one index tensor for all of them (not empty: every count is
        # positive), split into views; no Python frame but the bind's and the kernel's.
        positions = [obj for obj, _ in outs]
        views = [out for _, out in outs]
        one = len(counts) == 1
        kept = WeakHold()  # the stacked view of the latest first paged tensor

        def bind(p: TransferPlan) -> Kernel:
            ids = torch.frombuffer(array.array("q", p.request.block_ids[first:stop]), dtype=_I64)
            split = (ids,) if one else torch.split_with_sizes(ids, counts)
            steps = tuple(zip(positions, split, views, strict=True))

            def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
                # The first paged tensor: in line for one plain tensor or a list of them.
                u0 = paged if type(paged) is _Tensor else paged[0]
                if type(u0) is not _Tensor:
                    u0 = first_paged(paged)
                held = kept.held
                if held is not None and held[0][0]() is u0:
                    src = held[1]
                else:
                    src = u0.as_strided(*src_geo)
                    kept.hold((u0,), src)
                for obj, idx, (size, stride, offset) in steps:
                    out = objs[obj]
                    # A view from the chunk's start keeps its storage offset (as_strided's
                    # default): no storage_offset() call.
                    view = (
                        out.as_strided(size, stride, out.storage_offset() + offset)
                        if offset
                        else out.as_strided(size, stride)
                    )
                    torch.index_select(src, dim, idx, out=view)

            return gather

        return bind

    def bind_each(p: TransferPlan) -> Kernel:
        ids = p.request.block_ids
        steps = tuple(
            (obj, index_tensor(ids[start:stop]), out)
            for (obj, out), (start, stop) in zip(outs, ranges, strict=True)
        )
        return _stacked_kernel(src_geo, dim, steps)

    return bind_each


def _stacked_kernel(
    src_geo: tuple[Any, ...], dim: int, steps: tuple[tuple[int, torch.Tensor, Any], ...]
) -> Kernel:
    def gather(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        src = first_paged(paged).as_strided(*src_geo)
        for obj, ids, (size, stride, offset) in steps:
            out = objs[obj]
            view = out.as_strided(size, stride, out.storage_offset() + offset)
            torch.index_select(src, dim, ids, out=view)

    return gather


def _stacked_geometry(
    plan: TransferPlan, unit0: torch.Tensor, objs: Sequence[torch.Tensor]
) -> tuple[tuple[Any, ...], int, tuple[tuple[int, Any], ...]] | None:
    sv = plan.stacked
    assert sv is not None
    shape = plan.request.shape
    bpo = plan.request.chunk_size // shape.bs
    if len({seg.obj for seg in plan.segments}) != len(plan.segments) or any(
        objs[seg.obj].dtype is not unit0.dtype for seg in plan.segments
    ):
        return None
    size = sv.size
    stride = tuple(st if n > 1 else 1 for n, st in zip(size, sv.stride, strict=True))
    order = sorted(range(len(size)), key=lambda i: (size[i] == 1, -stride[i]))
    src = unit0.as_strided(size, stride, sv.storage_offset).permute(order)
    # The chunk is [P, L, J, S, H, D]: swap P and L into the stacked axis order, then permute.
    out_order = [(1, 0, 2, 3, 4, 5)[i] for i in order]
    dim = order.index(2)
    # torch's index_select on dim 1 makes a non-contiguous source contiguous first (a copy of
    # the whole pool per call: MLA pools with padded blocks or gapped layers, whose size-1
    # axes sort last). A leading size-1 axis moves the block axis to 2, off that path.
    lead = dim == 1 and not src.is_contiguous()
    if lead:
        src, dim = src.unsqueeze(0), 2
    outs = []
    for seg in plan.segments:
        obj = objs[seg.obj]
        out = object_view(plan.spec, obj, shape.nl, shape.nh, shape.hs, shape.bs)
        out = out.permute(out_order)
        if lead:
            out = out.unsqueeze(0)
        if out.shape[dim] != bpo:
            return None
        out = out.narrow(dim, seg.slot0, seg.count)
        offset = out.storage_offset() - obj.storage_offset()
        outs.append((seg.obj, (out.shape, out.stride(), offset)))
    return (src.shape, src.stride(), src.storage_offset()), dim, tuple(outs)


def _rows_steps(
    plan: TransferPlan, use_numpy: bool | None
) -> tuple[tuple[int, torch.Tensor, Any], ...]:
    """Per segment: its object, its flat row index ``[P*NL*bpo]`` as a tensor and (with
    numpy: ``use_numpy``, ``None`` where it is installed) as an array; every segment's in a
    handful of calls."""
    segs = plan.segments
    if numpy_usable() if use_numpy is None else use_numpy:
        flat_np = _rows_array(plan)
        flat = torch.from_numpy(flat_np).unbind(0)
        return tuple(zip([seg.obj for seg in segs], flat, flat_np, strict=True))
    g = plan.rows
    assert g is not None
    bpo = plan.request.chunk_size // plan.request.shape.bs
    block_ids = [plan.request.block_ids[seg.start : seg.stop] for seg in segs]
    ids = torch.tensor(block_ids, dtype=torch.int64)
    base = torch.tensor(g.plane_layer_rows, dtype=torch.int64)
    idx = torch.add(base.view(1, -1, 1), ids.view(len(segs), 1, bpo), alpha=g.block_rows)
    flat = idx.view(len(segs), -1).unbind(0)
    return tuple((seg.obj, t, None) for seg, t in zip(segs, flat, strict=True))


def _rows_array(plan: TransferPlan) -> Any:
    """Every segment's flat row index, ``[segments, P*NL*bpo]`` (numpy only: no torch
    call)."""
    import numpy as np

    g = plan.rows
    assert g is not None
    block_ids = [plan.request.block_ids[seg.start : seg.stop] for seg in plan.segments]
    ids_np = np.asarray(block_ids, dtype=np.int64) * g.block_rows
    flat_np = np.add.outer(np.asarray(g.plane_layer_rows, dtype=np.int64), ids_np)
    return flat_np.transpose(1, 0, 2).reshape(len(block_ids), -1)


def _run_staged(
    ctx: KernelContext,
    objs: list[torch.Tensor],
    copy: Callable[[torch.Tensor, torch.Tensor], None],
    scratch: ScratchCache,
    keep: list[torch.Tensor] | None,
) -> None:
    ctx.indices = scratch  # device index tensors come from (and stay in) the stream's cache
    if not ctx.plan.on_host:  # a new request: every segment's indices in one upload
        kind = "rows" if ctx.rows is not None else "ids"
        specs = [ctx.index_spec(kind, seg) for seg in ctx.plan.segments]
        scratch.prefetch(ctx.device, specs, keep)
    if single_kernel(ctx):
        for seg in ctx.plan.segments:
            staged_segment(ctx, seg, objs[seg.obj], copy, scratch)
        return
    d2h = ctx.plan.direction is Direction.D2H
    for seg in ctx.plan.segments:
        obj = objs[seg.obj]
        staging = scratch.get(ctx.device, obj.shape, obj.dtype)
        if d2h:
            gather_segment(ctx, seg, staging)
            copy(ctx.region(obj, seg), ctx.region(staging, seg))
        else:
            copy(ctx.region(staging, seg), ctx.region(obj, seg))
            scatter_segment(ctx, seg, staging, use_numpy=False)
