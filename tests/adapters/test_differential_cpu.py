"""Byte for byte against LMCache's torch path on CPU, for every format kvactors serves there.

The ``kvactors_cpu`` plugin's op (the runtime, its plan cache and kernels, as LMCache's worker
calls it) and LMCache's own torch op (``lmcache.v1.platform.torch_ops``, what LMCache runs on
CPU without kvactors) move identical freshly built operands; every byte of the host chunks
and of the paged memory must be equal afterwards. The systematic cases take every format in
both directions with the prefix skips the engine-driven path produces (0, one block, one
whole chunk), in each tensor form LMCache accepts (the fused K/V formats also as
``[..., 2, HS]``); the random cases add other allocations, dtypes, partial last chunks and
declared block strides. Runs under every installed LMCache (the test job runs it under 0.5.6
and 0.5.7rc2).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat
from tests._transfer_cases import ALLOCS, Case, raw

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

CPU = torch.device("cpu")
FUSED = sorted(f for f in KVFormat if FORMAT_SPECS[f].single_plane)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
RANDOM_CASES = 120


def _desc(case: Case, ops: Any) -> Any:
    sd = ops.PageBufferShapeDesc()
    shape = case.shape()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(shape, f))
    sd.dtype = case.dtype
    return sd


class _Run:
    """One contender's call on freshly built operands: the bytes afterwards."""

    def __init__(self, case: Case, ops: Any, ids: list[int], skip: int, direction: int) -> None:
        import lmcache.lmcache_native as native

        paged, objects, backing = case.build()
        ops.multi_layer_block_kv_transfer(
            paged, objects, list(ids), CPU, native.TransferDirection(direction),
            _desc(case, ops), case.bpo * case.bs, native.EngineKVFormat(int(case.fmt)), skip,
        )  # fmt: skip
        self.after = [raw(t).clone() for t in (*objects, *backing)]

    def same(self, other: _Run) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.after, other.after, strict=True))


class _TorchPath:
    """LMCache's own CPU op, with the descriptor class LMCache builds for it."""

    def __init__(self) -> None:
        import lmcache.lmcache_native as native
        from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

        self.PageBufferShapeDesc = native.PageBufferShapeDesc
        self.multi_layer_block_kv_transfer = multi_layer_block_kv_transfer


@pytest.fixture(scope="module")
def contenders() -> tuple[Any, Any]:
    from kvactors_lmcache.ops import KvactorsCpuOps

    return _TorchPath(), KvactorsCpuOps()


def _compare(contenders: tuple[Any, Any], case: Case, ids: list[int], skip: int, d: int) -> None:
    theirs, ours = contenders
    lm = _Run(case, theirs, ids, skip, d)
    kv = _Run(case, ours, ids, skip, d)
    assert kv.same(lm), f"bytes differ from LMCache's torch path: {case} ids={ids} skip={skip}"


def _systematic() -> list[Any]:
    out = []
    for fmt in KVFormat:
        forms = (False, True) if fmt in FUSED else (False,)
        for split in forms:
            for direction in (0, 1):
                for skip in ("none", "block", "chunk"):
                    out.append(pytest.param(fmt, split, direction, skip, id=f"{fmt.name}-"
                               f"{'split' if split else 'packed'}-{'D2H' if direction else 'H2D'}"
                               f"-skip_{skip}"))  # fmt: skip
    return out


@pytest.mark.parametrize(("fmt", "split", "direction", "skip"), _systematic())
def test_every_format_matches_lmcache_torch_path(
    contenders: tuple[Any, Any], fmt: KVFormat, split: bool, direction: int, skip: str
) -> None:
    mla = FORMAT_SPECS[fmt].is_mla
    case = Case(
        fmt=fmt, nl=3, nb=12, bs=4, nh=1 if mla else 2, hs=8, dtype=torch.bfloat16,
        alloc="separate", seed=11, n_objects=3, bpo=2, split_width=split,
    )  # fmt: skip
    ids = [9, 2, 7, 0, 11, 4]  # three full chunks
    _compare(contenders, case, ids, {"none": 0, "block": 1, "chunk": case.bpo}[skip], direction)


def test_random_cases_match_lmcache_torch_path(contenders: tuple[Any, Any]) -> None:
    rng = random.Random("differential-cpu")
    seen: set[KVFormat] = set()
    for i in range(RANDOM_CASES):
        fmt = rng.choice(list(KVFormat))
        mla = FORMAT_SPECS[fmt].is_mla
        case = Case(
            fmt=fmt,
            nl=rng.randint(1, 3),
            nb=rng.randint(6, 12),
            bs=rng.choice((1, 2, 4)),
            nh=1 if mla else rng.randint(1, 3),
            hs=rng.choice((2, 4, 8)),
            dtype=rng.choice(DTYPES),
            alloc=rng.choice(ALLOCS),
            seed=2000 + i,
            n_objects=rng.randint(1, 3),
            bpo=rng.randint(1, 3),
            declare_stride=rng.random() < 0.5,
            split_width=rng.random() < 0.5,
        )
        capacity = min(case.n_objects * case.bpo, case.nb)
        n_ids = rng.randint(max(1, capacity - case.bpo + 1), capacity)  # a partial last chunk
        direction = rng.choice((0, 1))
        ids = rng.sample(range(case.nb), n_ids)
        skip = rng.choice((0, 1, case.bpo, rng.randint(0, n_ids)))
        _compare(contenders, case, ids, skip, direction)
        seen.add(fmt)
    assert seen == set(KVFormat), seen
