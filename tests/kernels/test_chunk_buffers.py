"""Other chunk buffers of a known layout (LMCache's traffic: each store gathers into buffers
its host pool hands out): the runtime rebinds a validated plan to their addresses, and every
call moves exactly its own bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvactors.core.layouts import Direction, KVFormat
from kvactors.core.plans import plan_transfer
from kvactors.kernels.reference import run_reference
from kvactors.runtime import Runtime
from tests._transfer_cases import Case, raw, same_bytes

IDS = ([5, 0, 7, 2, 3, 6], [1, 4, 6, 7, 0, 5], [6, 1, 0, 3, 2, 4], [2, 3, 4, 5, 6, 7])


def _case(fmt: KVFormat, alloc: str) -> Case:
    mla = fmt is KVFormat.NL_X_NB_BS_HS
    return Case(
        fmt=fmt, nl=3, nb=8, bs=2, nh=1 if mla else 2, hs=4, dtype=torch.bfloat16,
        alloc=alloc, seed=3, n_objects=2, bpo=3,
    )  # fmt: skip


def _pool_buffers(like: list[torch.Tensor], pool: torch.Tensor, at: int) -> list[torch.Tensor]:
    """Chunk buffers shaped like ``like``, views of ``pool`` from element ``at`` on."""
    out = []
    for o in like:
        out.append(pool[at : at + o.numel()].view(o.shape))
        at += o.numel() + 1  # a gap: no two buffers touch
    return out


@pytest.mark.parametrize("alloc", ["stacked", "gapped", "separate"])
@pytest.mark.parametrize("fmt", list(KVFormat))
@pytest.mark.parametrize("direction", [int(Direction.H2D), int(Direction.D2H)])
def test_other_chunk_buffers_move_their_own_bytes(
    fmt: KVFormat, alloc: str, direction: int
) -> None:
    """The first call validates in full; the next ones, into views at other offsets of one
    host pool and into separate allocations, are rebound (ids and addresses) and move
    exactly the reference's bytes; no byte of the pool outside the call's buffers moves."""
    c = _case(fmt, alloc)
    paged, first, backing = c.build()
    ref_paged, _, ref_backing = c.build()  # identical contents
    pool = torch.zeros(8 * sum(o.numel() for o in first) + 64, dtype=c.dtype)
    raw(pool).random_(generator=torch.Generator().manual_seed(11))
    calls: list[list[torch.Tensor]] = [
        first,
        _pool_buffers(first, pool, 3),
        _pool_buffers(first, pool, 3 + 2 * sum(o.numel() + 1 for o in first)),
        [torch.empty_like(o) for o in first],
    ]
    g = torch.Generator().manual_seed(5)
    with Runtime("cpu") as rt:
        for k, (objs, ids) in enumerate(zip(calls, IDS, strict=True)):
            for o in objs:
                if direction == int(Direction.H2D) or k == 3:  # scatter sources, fresh memory
                    raw(o).random_(generator=g)
            ref_objs = [o.clone() for o in objs]
            pool_before = raw(pool).clone()
            rebound = rt.statistics().plans_rebound
            rt.transfer(c.request(direction, ids), paged, objs)
            if k:  # other buffers of the layout: no full validation
                assert rt.statistics().plans_rebound == rebound + 1
            run_reference(
                plan_transfer(c.request(direction, ids), ref_paged, ref_objs, device_type="cpu"),
                ref_paged,
                ref_objs,
            )
            assert same_bytes(backing, ref_backing)
            assert same_bytes(objs, ref_objs)
            outside = torch.ones(pool.numel(), dtype=torch.bool)
            for o in objs:
                if o.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr():
                    outside[o.storage_offset() : o.storage_offset() + o.numel()] = False
            assert torch.equal(raw(pool)[outside], pool_before[outside])


def test_a_chunk_of_another_layout_validates_in_full() -> None:
    """A buffer of other strides (a transposed view) is another layout: validated in full and
    refused (chunks must be contiguous), never rebound to the layout's plan."""
    c = _case(KVFormat.NL_X_TWO_NB_BS_NH_HS, "stacked")
    paged, objs, _ = c.build()
    with Runtime("cpu") as rt:
        rt.transfer(c.request(int(Direction.D2H), IDS[0]), paged, objs)
        o = objs[0]
        other: Any = torch.empty(o.shape[::-1], dtype=o.dtype).permute(*reversed(range(o.dim())))
        assert other.shape == o.shape
        assert other.stride() != o.stride()
        with pytest.raises(ValueError, match="contiguous"):
            rt.transfer(c.request(int(Direction.D2H), IDS[1]), paged, [other, objs[1]])
