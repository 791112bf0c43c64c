"""Paged KV given as per-layer views made by ``Runtime.tensor_from_ptr`` over one pool (a
caller mapping an engine's KV pool by pointer): each view has its own storage, so no single
view over the first one's storage covers the others. They move exactly as plain views of the
same pool do, both ways, in every format of more than one paged tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvactors.core.layouts import KVFormat, PagedKind
from kvactors.core.plans import plan_transfer
from kvactors.kernels.reference import run_reference
from kvactors.runtime import Runtime
from tests._transfer_cases import Case, same_bytes

LISTS = [f for f in KVFormat if Case(f, 1, 1, 1, 1, 1, torch.float32, "stacked", 0).spec.kind
         is not PagedKind.CROSS_LAYER]  # fmt: skip


def _case(fmt: KVFormat) -> Case:
    mla = Case(fmt, 1, 1, 1, 1, 1, torch.float32, "stacked", 0).spec.is_mla
    return Case(fmt, nl=3, nb=8, bs=2, nh=1 if mla else 2, hs=4, dtype=torch.bfloat16,
                alloc="stacked", seed=4, n_objects=2, bpo=3)  # fmt: skip


def _units(paged: Any) -> list[torch.Tensor]:
    if isinstance(paged, torch.Tensor):
        return [paged]
    if isinstance(paged[0], torch.Tensor):
        return list(paged)
    return [t for part in paged for t in part]


def _from_pointer(rt: Runtime, paged: Any) -> Any:
    def view(t: torch.Tensor) -> torch.Tensor:
        base = t.untyped_storage().data_ptr()
        return rt.tensor_from_ptr(
            base, t.shape, t.dtype, stride=t.stride(), storage_offset=int(t.storage_offset())
        )

    if isinstance(paged[0], torch.Tensor):
        return [view(t) for t in paged]
    return [[view(t) for t in part] for part in paged]


@pytest.mark.parametrize("fmt", LISTS)
@pytest.mark.parametrize("direction", [0, 1])
def test_per_layer_views_from_a_pointer_move_like_views_of_the_pool(
    fmt: KVFormat, direction: int
) -> None:
    case = _case(fmt)
    ids = [5, 0, 7, 2, 3, 6]
    want_paged, want_objs, want_back = case.build()
    run_reference(
        plan_transfer(case.request(direction, ids), want_paged, want_objs, device_type="cpu"),
        want_paged,
        want_objs,
    )
    paged, objs, back = case.build()
    with Runtime("cpu") as rt:
        views = _from_pointer(rt, paged)
        units = _units(views)
        assert len({t.untyped_storage().data_ptr() for t in units}) == 1
        assert len({t.untyped_storage().nbytes() for t in units}) == len(units)
        for _ in range(2):  # validated, then from the plan cache
            rt.transfer(case.request(direction, ids), views, objs)
        stats = rt.statistics()
    assert (stats.transfers_ok, stats.transfers_failed) == (2, 0)
    assert same_bytes(back, want_back)
    assert same_bytes(objs, want_objs)
