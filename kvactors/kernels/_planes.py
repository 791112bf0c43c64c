"""Host scatter of whole block planes: one numpy assignment per object and paged storage.

Theory of operation. The paged memory of one storage (the stacked ``[L, P, B, S, H, D]``
view when the plan found one, else each paged tensor's ``[P', B, S, H, D]``) is seen as
*rows*: row ``r`` is the block plane ``[S, H]`` starting ``r * g`` elements into the view,
``g`` the greatest common divisor of its layer, plane and block strides, and each item is
one ``HS`` run (a numpy ``void`` of ``D * itemsize`` bytes, so numpy moves a run per item
instead of walking its elements). The block
plane of ``(plane p, layer l, block b)`` is row ``base[p, l] + b * block_rows``, so the
rows of one segment are one small integer array ``[P, L, n]``, built once per plan.

A scatter is then, per object (per object and paged tensor when the layers are separate
allocations), ONE numpy fancy assignment ``rows[index] = chunk[P, L, n, S, H]``: numpy walks
the chunk sequentially, token-major, and writes whole ``HS`` runs, the fast order of a C
loop over the same runs (performance.md section 2), whatever the order of ``S`` and ``H`` in
the paged memory (NHD, HND, the fused K/V formats 10-13). Nothing chunk-sized is allocated;
what a call builds is a numpy view of each chunk (the paged tensors' rows arrays are kept
while calls pass those very tensors, weakly: :class:`WeakHold`), which is why this path beats
the per-segment views of :mod:`kvactors.kernels._moves` on small chunks (an engine's 64-token
chunks of a small model) as well as on large ones.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.plans import paged_units
from kvactors.kernels._views import (
    WeakHold,
    canonical_unit,
    first_paged,
    raw,
    stacked_view,
    unit_planes,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from kvactors.core.plan_cache import Binder, Kernel
    from kvactors.core.plans import TransferPlan

__all__ = ("planes_scatter_binder",)

_Tensor = torch.Tensor

# Dtypes numpy views without reinterpreting them as integers first (bfloat16 and fp8 need
# ``raw``; a view of the same bytes either way).
_NUMPY_DTYPES = frozenset(
    {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
     torch.int32, torch.int64, torch.bool}
)  # fmt: skip

# One paged storage seen as rows: (unit index or -1 for the stacked view, as_strided
# geometry of its [R, S, H, D] rows view, base row per (plane, layer) of the chunk it
# covers, block_rows, the chunk selection (planes, layers) it covers).
_Target = tuple[int, tuple[Any, ...], Any, int, tuple[slice | int, ...]]


def planes_scatter_binder(
    plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]
) -> Binder | None:
    """The binder of a host scatter (H2D) through numpy rows, or ``None`` when a block
    plane's ``HS`` axis is not contiguous (nothing to bind then). Needs numpy."""
    import numpy as np

    units = paged_units(plan.spec, paged)
    shape = plan.request.shape
    spec = plan.spec
    nl, planes = shape.nl, spec.planes
    targets: list[_Target] = []
    if plan.stacked is not None:
        view = stacked_view(plan.stacked, units[0])  # [L, P, B, S, H, D]
        geo = _rows_geometry(view, np)
        if geo is None:
            return None
        rows_geo, base, block_rows = geo  # base [L, P]
        targets.append((-1, rows_geo, base.T.copy(), block_rows, (slice(None), slice(None))))
    else:
        for u, t in enumerate(units):
            cu = canonical_unit(spec, t)  # [P', B, S, H, D]
            geo = _rows_geometry(cu.unsqueeze(0), np)
            if geo is None:
                return None
            rows_geo, base, block_rows = geo  # base [1, P']
            layer, prange = unit_planes(plan.spec, plan.request.shape.nl, u)
            sel = (slice(prange.start, prange.stop), layer)
            targets.append((u, rows_geo, base[0].copy(), block_rows, sel))
    item = np.dtype(f"V{shape.hs * plan.itemsize}")
    heads = 1 if spec.is_mla else shape.nh
    obj_shape = (planes, nl, -1, shape.bs, heads)
    as_raw = any(o.dtype not in _NUMPY_DTYPES for o in objects)
    segs = plan.segments
    bpo = plan.request.chunk_size // shape.bs
    if plan.stacked is not None and all(seg.count == bpo for seg in segs):
        # The common case (one stacked view, whole chunks): every segment's rows in one op.
        _, geo, base, block_rows, _ = targets[0]
        whole: tuple[Any, ...] = geo
        objs_order = tuple(seg.obj for seg in segs)
        first, stop = segs[0].start, segs[-1].stop
        contiguous = all(b.start == a.stop for a, b in itertools.pairwise(segs))
        kept = WeakHold()  # the rows array of the latest first paged tensor

        def bind_whole(p: TransferPlan) -> Kernel:
            if contiguous:
                ids = np.asarray(p.request.block_ids[first:stop], dtype=np.int64)
            else:
                ids = np.asarray(
                    [p.request.block_ids[s.start : s.stop] for s in segs], dtype=np.int64
                )
            index = base[None, :, :, None] + (ids * block_rows).reshape(len(segs), 1, 1, bpo)
            steps = tuple(zip(objs_order, index, strict=True))

            def scatter(paged: Any, objs: Sequence[torch.Tensor]) -> None:
                # The first paged tensor's rows array is kept while calls pass that very
                # tensor (a warm scatter makes no torch call of the pool's); no Python frame
                # but this one. A chunk's last axis is contiguous and holds whole HS runs:
                # viewed as items in place (``raw`` first where numpy has no such dtype).
                u0 = paged if type(paged) is _Tensor else paged[0]
                if type(u0) is not _Tensor:
                    u0 = first_paged(paged)
                held = kept.held
                if held is not None and held[0][0]() is u0:
                    rows = held[1]
                else:
                    rows = _void_rows(u0, whole, item, as_raw)
                    kept.hold((u0,), rows)
                for obj, idx in steps:
                    chunk = objs[obj]
                    chunk_np = (raw(chunk) if as_raw else chunk).numpy()
                    rows[idx] = chunk_np.view(item).reshape(obj_shape)

            return scatter

        return bind_whole

    kept_units = WeakHold()  # the latest call's paged tensors' rows arrays

    def bind(p: TransferPlan) -> Kernel:
        ids = np.asarray(p.request.block_ids, dtype=np.int64)
        steps = []
        for seg in segs:
            blocks = ids[seg.start : seg.stop]
            j = slice(seg.slot0, seg.slot0 + seg.count)
            for u, _, base, block_rows, sel in targets:
                index = np.add.outer(base, blocks * block_rows)  # [P, L, n] or [P', n]
                steps.append((seg.obj, u, (*sel, j), index))
        return _kernel(p, targets, item, obj_shape, as_raw, tuple(steps), kept_units)

    return bind


def _host_array(t: torch.Tensor, as_raw: bool) -> np.ndarray[Any, Any]:
    return (raw(t) if as_raw else t).numpy()


def _kernel(
    plan: TransferPlan,
    targets: list[_Target],
    item: np.dtype[Any],
    obj_shape: tuple[int, ...],
    as_raw: bool,
    steps: tuple[tuple[int, int, tuple[Any, ...], Any], ...],
    kept: WeakHold,
) -> Kernel:
    spec = plan.spec
    geos = {t[0]: t[1] for t in targets}

    def scatter(paged: Any, objs: Sequence[torch.Tensor]) -> None:
        # The paged tensors' rows arrays are kept while calls pass those very tensors.
        units = [first_paged(paged)] if -1 in geos else paged_units(spec, paged)
        rows: dict[int, Any] | None = kept.kept(units)
        if rows is None:
            if -1 in geos:
                rows = {-1: _void_rows(units[0], geos[-1], item, as_raw)}
            else:
                rows = {u: _void_rows(units[u], geo, item, as_raw) for u, geo in geos.items()}
            kept.hold(units, rows)
        chunks: dict[int, Any] = {}
        for obj, u, sel, index in steps:
            chunk = chunks.get(obj)
            if chunk is None:
                chunk = _host_array(objs[obj], as_raw).view(item)
                chunk = chunks[obj] = chunk.reshape(obj_shape)
            rows[u][index] = chunk[sel]

    return scatter


def _void_rows(
    t: torch.Tensor, geo: tuple[Any, ...], item: np.dtype[Any], as_raw: bool
) -> np.ndarray[Any, Any]:
    """The ``[R, S, H]`` rows of ``HS`` runs (geometry checked when bound: ``D`` is the
    contiguous last axis)."""
    return _host_array(t.as_strided(*geo), as_raw).view(item)[..., 0]


def _rows_geometry(
    view: torch.Tensor, np: Any
) -> tuple[tuple[Any, ...], np.ndarray[Any, Any], int] | None:
    """``[L, P, B, S, H, D]`` -> (as_strided geometry of its ``[R, S, H, D]`` rows, base rows
    ``[L, P]``, block_rows), or ``None`` when ``D`` is not contiguous."""
    nl, planes, nb, s, h, d = view.shape
    sl, sp, sb, ss, sh, sd = view.stride()
    if d > 1 and sd != 1:
        return None
    g = 0
    for n, st in ((nl, sl), (planes, sp), (nb, sb)):
        if n > 1:
            g = math.gcd(g, st)
    g = g or 1
    span = (nl - 1) * sl + (planes - 1) * sp + (nb - 1) * sb
    geo = ((span // g + 1, s, h, d), (g, ss, sh, 1), view.storage_offset())
    base = np.add.outer(np.arange(nl) * (sl // g), np.arange(planes) * (sp // g))
    return geo, base, sb // g
