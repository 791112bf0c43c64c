"""View builders shared by the fast kernels (metadata only: no data is read or written here).

Fast paths work on canonical views reinterpreted as same-width integers: a paged tensor
``[P, B, S, H, D]``, the stacked memory ``[L, P, B, S, H, D]``, a host chunk
``[P, L, J, S, H, D]``. Before an ``index_select`` both sides are permuted into the paged
memory's physical order, the order in which torch's ``index_select`` is fast.
"""

from __future__ import annotations

import array
import weakref
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import FormatSpec, PagedKind

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvactors.core.plans import StackedView

__all__ = (
    "WeakHold",
    "block_runs",
    "canonical_unit",
    "first_paged",
    "index_tensor",
    "object_view",
    "physical_order",
    "raw",
    "stacked_view",
    "unit_planes",
)


class WeakHold:
    """A kernel's views of the paged tensors of its latest call, kept while calls pass those
    very tensors: ``held`` is ``(weak references to the tensors, the views)``, dropped as soon
    as one of the tensors goes (a kept view never keeps the pool alive)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: tuple[tuple[weakref.ref[torch.Tensor], ...], Any] | None = None

    def hold(self, tensors: Sequence[torch.Tensor], views: Any) -> None:
        """Keep ``views`` while every one of ``tensors`` lives."""
        self.held = (tuple(weakref.ref(t, self._let_go) for t in tensors), views)

    def kept(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The views kept for these very tensors (the same objects, in order), else None."""
        held = self.held
        if held is None or len(held[0]) != len(tensors):
            return None
        for ref, t in zip(held[0], tensors, strict=True):
            if ref() is not t:
                return None
        return held[1]

    def _let_go(self, ref: weakref.ref[torch.Tensor]) -> None:
        held = self.held
        if held is not None and ref in held[0]:
            self.held = None


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of the same width (no copy)."""
    return t.view(_RAW[t.element_size()])


def first_paged(paged: Any) -> torch.Tensor:
    """The first paged tensor of a matched structure: one tensor, a list of layers, or K/V
    lists (nested or flat)."""
    if isinstance(paged, torch.Tensor):
        return paged
    first = paged[0]
    return first if isinstance(first, torch.Tensor) else first[0]  # type: ignore[no-any-return]


def canonical_unit(spec: FormatSpec, t: torch.Tensor) -> torch.Tensor:
    """One per-layer (or per-plane) paged tensor as ``[P, B, S, H, D]``."""
    v = t
    axes = list(spec.axes)
    for a in "PBSHD":
        if a not in axes:
            v = v.unsqueeze(len(axes))
            axes.append(a)
    return v.permute([axes.index(a) for a in "PBSHD"])


def stacked_view(view: StackedView, first: torch.Tensor) -> torch.Tensor:
    """The ``[L, P, B, S, H, D]`` view over every paged tensor (storage of ``first``)."""
    stride = tuple(s if n > 1 else 1 for n, s in zip(view.size, view.stride, strict=True))
    return first.as_strided(view.size, stride, view.storage_offset)


def object_view(
    spec: FormatSpec, obj: torch.Tensor, nl: int, nh: int, hs: int, bs: int
) -> torch.Tensor:
    """A host chunk as ``[P, L, J, S, H, D]``."""
    planes = spec.planes
    heads = 1 if spec.is_mla else nh
    slots = obj.numel() // (planes * nl * bs * heads * hs)
    return obj.view(planes, nl, slots, bs, heads, hs)


def physical_order(t: torch.Tensor) -> list[int]:
    """Axes of ``t`` by decreasing stride (size-1 axes last), ties keep their order."""
    size, stride = tuple(t.shape), t.stride()
    return sorted(range(t.dim()), key=lambda i: (size[i] == 1, -stride[i]))


def block_runs(ids: tuple[int, ...] | list[int]) -> list[tuple[int, int, int]]:
    """``(slot, block, length)`` for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for k, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            slot, start, n = runs[-1]
            runs[-1] = (slot, start, n + 1)
        else:
            runs.append((k, b, 1))
    return runs


def unit_planes(spec: FormatSpec, nl: int, u: int) -> tuple[int, range]:
    """Layer and planes (as indices into ``P``) held by paged tensor ``u``."""
    if spec.is_kv_list:
        return u % nl, range(u // nl, u // nl + 1)
    return u, range(spec.planes)


def index_tensor(ids: Sequence[int]) -> torch.Tensor:
    """An int64 CPU tensor of ``ids``, built over an ``array`` buffer (the tensor keeps it):
    cheaper than ``torch.tensor(ids)``."""
    if not ids:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64)


def is_kv_list(spec: FormatSpec) -> bool:
    """Whether each paged tensor holds one plane of one layer."""
    return spec.kind is PagedKind.KV_LIST
