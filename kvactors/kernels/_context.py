"""Per-call views for the fast kernels, built once from a plan and its operands.

Theory of operation. A :class:`KernelContext` turns a plan (metadata) plus the operands it was
made for into the strided views every fast path needs: the paged tensors as same-width integer
views, the stacked ``[L, P, B, S, H, D]`` view when the plan found one, and the "rows" view
(every block plane of every layer one row of ``BS*NH*HS`` elements) when the plan found the
stacked memory tight. Building these costs a few microseconds and allocates nothing but the
tiny index tensors; only the views a path uses are built (the per-tensor integer views only
when a per-layer path needs them).

The index tensors (block ids, row numbers) depend on the plan alone, so a caller that reuses
a plan can pass a *memo* dict kept with it: the tensors are built on the first call and read
from the memo afterwards (they are never written by a kernel, so sharing them between calls
and threads is safe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvactors.kernels._views import canonical_unit, object_view, raw, stacked_view, void_view

if TYPE_CHECKING:
    import numpy as np

    from kvactors.plans import Segment, TransferPlan

__all__ = ("KernelContext",)


class KernelContext:
    """The views of one fast-kernel call (see the module docstring)."""

    __slots__ = (
        "_first",
        "_given",
        "_memo",
        "_plane_views",
        "_plane_voids",
        "_stacked",
        "_stacked_void",
        "_unit_views",
        "_units",
        "bpo",
        "device",
        "nl",
        "plan",
        "planes",
        "rows",
    )

    def __init__(
        self,
        plan: TransferPlan,
        units: list[torch.Tensor],
        memo: dict[Any, Any] | None = None,
    ) -> None:
        self.plan = plan
        self._given = units
        self._units: list[torch.Tensor] | None = None
        self._memo: dict[Any, Any] = {} if memo is None else memo
        first = raw(units[0])
        self.device = first.device
        shape = plan.request.shape
        self.nl = shape.nl
        self.planes = plan.spec.planes
        self.bpo = plan.request.chunk_size // shape.bs
        self._first = first
        self._stacked: tuple[torch.Tensor | None] | None = None
        g = plan.rows
        self.rows = (
            None
            if g is None
            else first.as_strided((g.nrows, g.piece), (g.row_stride, 1), g.storage_offset)
        )
        self._plane_views: list[tuple[torch.Tensor, int]] | None = None
        self._plane_voids: (
            tuple[list[tuple[np.ndarray[Any, np.dtype[np.void]], int]] | None] | None
        ) = None
        self._unit_views: list[tuple[torch.Tensor, int, range]] | None = None
        self._stacked_void: tuple[np.ndarray[Any, np.dtype[np.void]] | None] | None = None

    @property
    def stacked(self) -> torch.Tensor | None:
        """The ``[L, P, B, S, H, D]`` view over every paged tensor, or ``None`` when the plan
        found none (built on first use)."""
        if self._stacked is None:
            sv = self.plan.stacked
            self._stacked = (None if sv is None else stacked_view(sv, self._first),)
        return self._stacked[0]

    @property
    def units(self) -> list[torch.Tensor]:
        """The paged tensors as same-width integer views (built on first use)."""
        if self._units is None:
            self._units = [raw(t) for t in self._given]
        return self._units

    def stacked_void(self) -> np.ndarray[Any, np.dtype[np.void]] | None:
        """:attr:`stacked` as the numpy ``[L, P, B, S, H]`` array of ``HS`` runs
        (:func:`~kvactors.kernels._views.void_view`); CPU and numpy only; built once per call."""
        if self._stacked_void is None:
            assert self.stacked is not None
            self._stacked_void = (void_view(self.stacked),)
        return self._stacked_void[0]

    def plane_views(self) -> list[tuple[torch.Tensor, int]]:
        """``(rows, i)`` per (paged tensor, plane): the plane as ``[NB, BS*NH*HS]`` rows and
        its row ``i`` in :meth:`plane_rows`. Only for tight plans; built once per call."""
        if self._plane_views is None:
            views: list[tuple[torch.Tensor, int]] = []
            for u, t in enumerate(self.units):
                layer, planes = self.unit_planes(u)
                cu = canonical_unit(self.plan.spec, t)
                for k, p in enumerate(planes):
                    plane = cu[k]
                    rows = plane.as_strided((plane.size(0), plane[0].numel()), (plane.stride(0), 1))
                    views.append((rows, p * self.nl + layer))
            self._plane_views = views
        return self._plane_views

    def plane_voids(self) -> list[tuple[np.ndarray[Any, np.dtype[np.void]], int]] | None:
        """:meth:`plane_views` as numpy arrays of whole block planes (one ``void`` item per
        block), or ``None`` when a plane is not contiguous (numpy's ``take`` would copy it
        first); CPU and numpy only; built once per call."""
        if self._plane_voids is None:
            voids: list[tuple[np.ndarray[Any, np.dtype[np.void]], int]] | None = []
            for u, t in enumerate(self.units):
                # One numpy array per paged tensor, [P', B] of whole block planes: a numpy
                # call per plane is cheap, building a view per plane is not (64 per layer set).
                layer, planes = self.unit_planes(u)
                cu = canonical_unit(self.plan.spec, t)
                rows = cu.as_strided(
                    (cu.size(0), cu.size(1), cu[0, 0].numel()), (cu.stride(0), cu.stride(1), 1)
                )
                a = void_view(rows)
                if a is None or not all(a[k].flags.c_contiguous for k in range(len(planes))):
                    voids = None
                    break
                assert voids is not None
                voids.extend((a[k], p * self.nl + layer) for k, p in enumerate(planes))
            self._plane_voids = (voids,)
        return self._plane_voids[0]

    def unit_views(self) -> list[tuple[torch.Tensor, int, range]]:
        """``(view, layer, planes)`` per paged tensor, the view ``[P', B, S, H, D]``."""
        if self._unit_views is None:
            self._unit_views = [
                (canonical_unit(self.plan.spec, t), *self.unit_planes(u))
                for u, t in enumerate(self.units)
            ]
        return self._unit_views

    def ids(self, seg: Segment, device: torch.device | None = None) -> torch.Tensor:
        """The segment's block ids as an int64 tensor on ``device`` (default: the paged
        device); memoised."""
        dev = self.device if device is None else device
        key = ("ids", seg.start, seg.stop, str(dev))
        t = self._memo.get(key)
        if t is None:
            t = torch.tensor(
                self.plan.request.block_ids[seg.start : seg.stop], dtype=torch.int64, device=dev
            )
            self._memo[key] = t
        return t

    def row_index(self, seg: Segment, device: torch.device | None = None) -> torch.Tensor:
        """Row numbers ``[P*NL, n]`` of the segment's blocks in :attr:`rows`, plane-major;
        memoised."""
        dev = self.device if device is None else device
        key = ("rows", seg.start, seg.stop, str(dev))
        t = self._memo.get(key)
        if t is None:
            g = self.plan.rows
            assert g is not None
            ids = self.ids(seg, dev)
            base = torch.tensor(g.plane_layer_rows, dtype=torch.int64, device=dev)
            t = base.view(-1, 1) + ids.view(1, -1) * g.block_rows
            self._memo[key] = t
        return t

    def target_view(self, obj: torch.Tensor) -> torch.Tensor:
        """A (raw) host chunk or staging buffer as ``[P, L, J, S, H, D]``."""
        shape = self.plan.request.shape
        return object_view(self.plan.spec, obj, shape.nl, shape.nh, shape.hs, shape.bs)

    def plane_rows(self, obj: torch.Tensor) -> torch.Tensor:
        """A (raw) host chunk or staging buffer as ``[P*NL, J, BS*NH*HS]``."""
        return obj.view(self.planes * self.nl, self.bpo, -1)

    def unit_planes(self, u: int) -> tuple[int, range]:
        """Layer and planes (as indices into ``P``) held by paged tensor ``u``."""
        if self.plan.spec.is_kv_list:
            return u % self.nl, range(u // self.nl, u // self.nl + 1)
        return u, range(self.planes)
