"""Per-call views for the fast kernels, built once from a plan and its operands.

A :class:`KernelContext` turns a plan and its operands into the views a path needs (integer
views of the paged tensors, the stacked ``[L, P, B, S, H, D]`` view, the rows view), building
only what the path uses. Index tensors depend on the plan alone and may be kept with it; on an
accelerator they are keyed by content in the stream's :class:`ScratchCache`, which also holds
the staging buffers.
"""

from __future__ import annotations

import array
import collections
import functools
from typing import TYPE_CHECKING, Any

import torch

from kvactors.kernels._views import (
    canonical_unit,
    object_view,
    raw,
    stacked_view,
    unit_planes,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from kvactors.core.plans import Segment, TransferPlan

__all__ = ("KernelContext", "ScratchCache", "index_values")


class ScratchCache:
    """Reusable device buffers of one stream: staging buffers keyed by device, shape and
    dtype, and index tensors (block ids, row numbers) keyed by their content.

    Not thread-safe, and meant for one stream: see the module docstring (only
    :meth:`invalidate` may be called from any thread). ``allocations`` counts the buffers and
    index tensors ever allocated (``DeviceStatistics.scratch_allocations``: it stays flat on a
    warm hot path). At most ``index_capacity`` index tensors are kept (least recently used go
    first); a repeated request finds its indices on the device and uploads nothing.
    """

    __slots__ = ("_buffers", "_indices", "_stale", "allocations", "index_capacity", "views")

    def __init__(self, index_capacity: int = 256) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._indices: collections.OrderedDict[tuple[str, Hashable], torch.Tensor] = (
            collections.OrderedDict()
        )
        self.index_capacity = index_capacity
        self.allocations = 0
        self._stale = False
        #: Views of the staging buffers, made once each (keyed by the buffer's ``id`` and the
        #: view's geometry): they live and go with the buffers.
        self.views: dict[Hashable, torch.Tensor] = {}

    def get(self, device: torch.device, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The buffer for ``(device, shape, dtype)``; allocated on first use only."""
        key = (str(device), tuple(shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(key[1], dtype=dtype, device=device)
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def index(
        self, device: torch.device, key: Hashable, values: Callable[[], list[int]]
    ) -> torch.Tensor:
        """The int64 tensor of ``values()`` on ``device``; ``key`` must determine the values.

        Uploaded on first use only (:meth:`prefetch`); later calls read it from the cache.
        """
        full = (str(device), key)
        hit = self._indices.get(full)
        if hit is None:
            self.prefetch(device, [(key, values)])
            hit = self._indices[full]
        else:
            self._indices.move_to_end(full)
        return hit

    def invalidate(self) -> None:
        """Forget every index tensor before the next use (any thread): work on this stream
        failed, so an upload made without waiting (``prefetch(..., keep)``) may never have
        landed, although a later synchronize may clear the stream's error."""
        self._stale = True

    def prefetch(
        self,
        device: torch.device,
        specs: Sequence[tuple[Hashable, Callable[[], list[int]]]],
        keep: list[torch.Tensor] | None = None,
    ) -> None:
        """Upload every index of ``specs`` (``(key, values)``) not cached yet, in ONE copy.

        With ``keep``, on an accelerator, the copy is ``non_blocking``, on the current stream
        (the one this cache serves), from a pinned host tensor appended to ``keep``: the
        caller keeps ``keep`` alive until the stream ran the copy (rule 3), every later use
        of the entries is on that stream, behind the copy, and whoever sees work on the
        stream fail calls :meth:`invalidate`. Otherwise (or where host memory cannot be
        pinned) the upload is synchronous: the host waits for the stream, and the entries
        enter the cache only once the copy returned. A failed upload raises here and caches
        nothing. Only misses cost anything: one upload per call with new block ids.
        """
        if self._stale:
            self._stale = False
            self._indices.clear()
        dev_name = str(device)
        missing: dict[Hashable, list[int]] = {}
        for key, values in specs:
            full = (dev_name, key)
            if full in self._indices:
                self._indices.move_to_end(full)  # this call's entries are evicted last
            elif key not in missing:
                missing[key] = values()
        if not missing:
            return
        flat = [v for vals in missing.values() for v in vals]
        buf = None
        if keep is not None and device.type != "cpu":
            try:
                host = torch.frombuffer(array.array("q", flat), dtype=torch.int64).pin_memory()
            except RuntimeError:  # no pinned memory here: the synchronous upload below
                pass
            else:
                keep.append(host)
                buf = host.to(device, non_blocking=True)
        if buf is None:
            # A synchronous upload (torch copies host data to the device before it returns,
            # or raises); the current stream's error state is not consumed by it.
            buf = torch.tensor(flat, dtype=torch.int64, device=device)
        if device.type != "cpu":
            self.allocations += 1
        off = 0
        for key, vals in missing.items():
            self._indices[(dev_name, key)] = buf[off : off + len(vals)]
            off += len(vals)
        while len(self._indices) > max(self.index_capacity, len(specs)):
            self._indices.popitem(last=False)

    def fetch(
        self,
        device: torch.device,
        keys: Sequence[Hashable],
        values: Callable[[Hashable], list[int]],
        keep: list[torch.Tensor] | None,
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One staged call's device tensors: the index tensors of ``keys``, in order
        (``values(key)`` gives a missing one's integers, all of them uploaded at once as
        :meth:`prefetch` does), and :meth:`get`'s buffer of every shape of ``shapes`` in
        ``dtype``, in order (a shape twice: the same buffer twice)."""
        dev_name = str(device)
        have = self._buffers
        bufs: list[torch.Tensor] = []
        for shape in shapes:  # a loop, not a comprehension: no Python frame
            buf = have.get((dev_name, shape, dtype))
            bufs.append(buf if buf is not None else self.get(device, shape, dtype))
        found = self._indices
        out: list[torch.Tensor] = []
        if not self._stale:
            try:
                for key in keys:
                    full = (dev_name, key)
                    out.append(found[full])
                    found.move_to_end(full)  # this call's are evicted last
            except KeyError:
                out.clear()
            else:
                return out, bufs
        self.prefetch(device, [(key, functools.partial(values, key)) for key in keys], keep)
        for key in keys:
            out.append(found[(dev_name, key)])
        return out, bufs

    def clear(self) -> None:
        """Drop every buffer (only once no stream still uses them)."""
        self._buffers.clear()
        self.views.clear()
        self._indices.clear()
        self._stale = False

    def __len__(self) -> int:
        return len(self._buffers)


class KernelContext:
    """The views of one fast-kernel call (see the module docstring)."""

    __slots__ = (
        "_first",
        "_given",
        "_memo",
        "_plane_views",
        "_stacked",
        "_unit_views",
        "_units",
        "bpo",
        "device",
        "indices",
        "nl",
        "plan",
        "planes",
        "rows",
    )

    def __init__(
        self,
        plan: TransferPlan,
        units: list[torch.Tensor],
        memo: dict[tuple[str, int, int, str], torch.Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self._given = units
        self._units: list[torch.Tensor] | None = None
        self._memo: dict[tuple[str, int, int, str], torch.Tensor] = {} if memo is None else memo
        #: The stream's cache of device index tensors (set by the staged path), or None.
        self.indices: ScratchCache | None = None
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
        self._unit_views: list[tuple[torch.Tensor, int, range]] | None = None

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

    def unit_views(self) -> list[tuple[torch.Tensor, int, range]]:
        """``(view, layer, planes)`` per paged tensor, the view ``[P', B, S, H, D]``."""
        if self._unit_views is None:
            self._unit_views = [
                (canonical_unit(self.plan.spec, t), *self.unit_planes(u))
                for u, t in enumerate(self.units)
            ]
        return self._unit_views

    def index_spec(self, kind: str, seg: Segment) -> tuple[Hashable, Callable[[], list[int]]]:
        """Key and values of the segment's ``"ids"`` (block ids) or ``"rows"`` (row numbers
        ``[P*NL, n]`` of :attr:`rows`, plane-major, flattened) index, for :attr:`indices`."""
        block_ids = self.plan.request.block_ids[seg.start : seg.stop]
        key: Hashable
        if kind == "ids":
            key = ("ids", block_ids)
        else:
            g = self.plan.rows
            assert g is not None
            key = ("rows", block_ids, g.plane_layer_rows, g.block_rows)
        return key, functools.partial(index_values, key)

    def ids(self, seg: Segment, device: torch.device | None = None) -> torch.Tensor:
        """The segment's block ids as an int64 tensor on ``device`` (default: the paged
        device); memoised (on an accelerator in :attr:`indices`, by content, when set)."""
        dev = self.device if device is None else device
        if self.indices is not None and dev.type != "cpu":
            return self.indices.index(dev, *self.index_spec("ids", seg))
        key = ("ids", seg.start, seg.stop, str(dev))
        t = self._memo.get(key)
        if t is None:
            block_ids = self.plan.request.block_ids[seg.start : seg.stop]
            t = torch.tensor(block_ids, dtype=torch.int64, device=dev)
            self._memo[key] = t
        return t

    def row_index(self, seg: Segment, device: torch.device | None = None) -> torch.Tensor:
        """Row numbers ``[P*NL, n]`` of the segment's blocks in :attr:`rows`, plane-major;
        memoised (on an accelerator in :attr:`indices`, by content, when set)."""
        dev = self.device if device is None else device
        g = self.plan.rows
        assert g is not None
        if self.indices is not None and dev.type != "cpu":
            flat = self.indices.index(dev, *self.index_spec("rows", seg))
            return flat.view(len(g.plane_layer_rows), seg.count)
        key = ("rows", seg.start, seg.stop, str(dev))
        t = self._memo.get(key)
        if t is None:
            ids = self.ids(seg, dev)
            base = torch.tensor(g.plane_layer_rows, dtype=torch.int64, device=dev)
            t = base.view(-1, 1) + ids.view(1, -1) * g.block_rows
            self._memo[key] = t
        return t

    def target_view(self, obj: torch.Tensor) -> torch.Tensor:
        """A (raw) host chunk or staging buffer as ``[P, L, J, S, H, D]``."""
        shape = self.plan.request.shape
        return object_view(self.plan.spec, obj, shape.nl, shape.nh, shape.hs, shape.bs)

    def region(self, t: torch.Tensor, seg: Segment) -> torch.Tensor:
        """The part of a chunk-shaped tensor the segment covers (the whole tensor when full)."""
        if seg.count == self.bpo:
            return t
        return self.target_view(t)[:, :, seg.slot0 : seg.slot0 + seg.count]

    def plane_rows(self, obj: torch.Tensor) -> torch.Tensor:
        """A (raw) host chunk or staging buffer as ``[P*NL, J, BS*NH*HS]``."""
        return obj.view(self.planes * self.nl, self.bpo, -1)

    def unit_planes(self, u: int) -> tuple[int, range]:
        """Layer and planes (as indices into ``P``) held by paged tensor ``u``."""
        return unit_planes(self.plan.spec, self.nl, u)


def index_values(key: Hashable) -> list[int]:
    """An index's integers from its :class:`ScratchCache` key (the one mapping the bound and
    unbound paths share): ``("ids", ids)``, or ``("rows", ids, planes, block_rows)``, the row
    numbers plane-major."""
    parts: tuple[Any, ...] = key  # type: ignore[assignment]
    if parts[0] == "ids":
        return list(parts[1])
    ids: tuple[int, ...] = parts[1]
    planes: tuple[int, ...] = parts[2]
    block_rows: int = parts[3]
    return [r + b * block_rows for r in planes for b in ids]
