"""Device operations of the staged kernel path beyond the budget's steady state, on the fakes.

A call with block ids never seen on the stream uploads all of the call's indices in ONE
synchronous copy (not one per chunk), and a repeat uploads nothing; a segment covering part
of a chunk still takes one kernel, and its D2H into the strided chunk region blocks (rule 6)
while a full chunk's D2H does not. Bytes are checked against the host reference.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvactors.core.layouts import ShapeDesc
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.devices.mlu import MluBackend
from kvactors.devices.musa import MusaBackend
from kvactors.kernels.fast import ScratchCache, run_fast
from kvactors.testing import fake_vendor

KIND = os.environ.get("KVACTORS_FAKE_VENDOR", "mlu")
NL, NB, BS, NH, HS, BPO = 4, 32, 4, 2, 8, 4
FMTS = {"NHD": 1, "HND": 6}


def _setup(fake, layout: str, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    unit = (2, NB, BS, NH, HS) if layout == "NHD" else (2, NB, NH, BS, HS)
    host_pool = torch.randn((NL, *unit), generator=gen).to(torch.bfloat16)
    pool = fake.to_device(host_pool.clone())
    return host_pool, list(pool.unbind(0))


def _request(layout: str, ids: tuple[int, ...], direction: int, skip: int = 0) -> TransferRequest:
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    return TransferRequest(
        fmt=FMTS[layout],
        direction=direction,
        block_ids=ids,
        chunk_size=BPO * BS,
        skip_blocks=skip,
        shape=shape,
    )


def _objects(n: int) -> list[torch.Tensor]:
    return [
        torch.full((2, NL, BPO * BS, NH * HS), -1.0, dtype=torch.bfloat16).pin_memory()
        for _ in range(n)
    ]


def _expected(
    host_pool: torch.Tensor, layout: str, ids: tuple[int, ...], skip: int
) -> list[torch.Tensor]:
    nhd = host_pool if layout == "NHD" else host_pool.transpose(3, 4)  # [L, 2, NB, BS, NH, HS]
    out = _objects(len(ids) // BPO)
    for k, b in enumerate(ids):
        if k < skip:
            continue
        o, j = divmod(k, BPO)
        blk = nhd[:, :, b].reshape(NL, 2, BS, NH * HS).transpose(0, 1)
        out[o][:, :, j * BS : (j + 1) * BS] = blk
    return out


def _backend():  # type: ignore[no-untyped-def]
    return MluBackend(layout_source="resolved") if KIND == "mlu" else MusaBackend()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_new_block_ids_cost_one_upload_per_call_and_a_repeat_none(layout: str) -> None:
    with fake_vendor(KIND, seed=1) as fake:
        host_pool, paged = _setup(fake, layout)
        backend, scratch = _backend(), ScratchCache()
        rng = random.Random(0)
        for attempt in range(2):
            ids = tuple(rng.sample(range(NB), 2 * BPO))
            objs = _objects(2)
            plan = plan_transfer(
                _request(layout, ids, 1), paged, objs, device_type=KIND, device_index=0
            )
            with fake.counting() as first:
                run_fast(plan, paged, objs, copy=backend.copy_, scratch=scratch)
            fake.synchronize()
            with fake.counting() as again:
                run_fast(plan, paged, objs, copy=backend.copy_, scratch=scratch)
            fake.synchronize()
            c, r = first.counts, again.counts
            # One index upload for both chunks (the staging buffer only on the very first call).
            assert (c.h2d, c.d2h, c.launches) == (1, 2, 2), (attempt, c)
            assert (c.syncs, c.allocations) == (1, 2 if attempt == 0 else 1), (attempt, c)
            assert (r.h2d, r.d2h, r.launches, r.syncs, r.allocations) == (0, 2, 2, 0, 0), r
            for got, want in zip(objs, _expected(host_pool, layout, ids, 0), strict=True):
                assert torch.equal(got, want)


def test_partial_segment_takes_one_kernel_and_its_strided_d2h_blocks() -> None:
    with fake_vendor(KIND, seed=2) as fake:
        host_pool, paged = _setup(fake, "NHD")
        backend, scratch = _backend(), ScratchCache()
        ids = tuple(random.Random(3).sample(range(NB), 2 * BPO))
        objs = _objects(2)
        plan = plan_transfer(
            _request("NHD", ids, 1, skip=1), paged, objs, device_type=KIND, device_index=0
        )
        run_fast(plan, paged, objs, copy=backend.copy_, scratch=scratch)
        fake.synchronize()
        with fake.counting() as ops:
            run_fast(plan, paged, objs, copy=backend.copy_, scratch=scratch)
        fake.synchronize()
        c = ops.counts
        assert (c.h2d, c.d2h, c.launches, c.allocations) == (0, 2, 2, 0), c
        # The strided D2H of the partial first chunk blocks (rule 6; both backends' default
        # policy), the full second chunk's does not.
        assert backend.blocking_strided_d2h
        assert c.syncs == 1, c
        for got, want in zip(objs, _expected(host_pool, "NHD", ids, 1), strict=True):
            assert torch.equal(got, want)


def test_index_cache_keeps_a_whole_call_and_evicts_least_recently_used() -> None:
    cpu = torch.device("cpu")
    cache = ScratchCache(index_capacity=1)

    def never() -> list[int]:
        raise AssertionError("re-uploaded a cached index")

    cache.prefetch(cpu, [("a", lambda: [1, 2]), ("b", lambda: [3])])  # one call, two indices
    assert cache.index(cpu, "a", never).tolist() == [1, 2]
    assert cache.index(cpu, "b", never).tolist() == [3]
    cache.prefetch(cpu, [("c", lambda: [4])])  # a later call: only the capacity stays
    assert cache.index(cpu, "c", never).tolist() == [4]
    assert cache.index(cpu, "a", lambda: [5]).tolist() == [5]  # evicted: built again
