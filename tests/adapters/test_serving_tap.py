"""The serving validation's tap (kvactors_serving.tap) on LMCache's own CPU op.

The engine test runs the tap inside vLLM; here it runs on format 12 blocks (vLLM CPU
attention's [NB, NH, BS, 2*HS] per layer) in-process, so its own rules are checked fast: a
restore that brings back other bytes is named, a store that writes other bytes than LMCache's
op is named, the wrapper keeps the annotation LMCache reads.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

NB, NH, BS, HS2, NL, CHUNK = 12, 2, 4, 16, 2, 8  # 2 blocks per chunk


def _setup():
    from lmcache import lmcache_native as native
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as lmcache_op

    sd = native.PageBufferShapeDesc()
    for f, v in {
        "kv_size": 1,
        "nl": NL,
        "nb": NB,
        "bs": BS,
        "nh": NH,
        "hs": HS2,
        "element_size": 4,
        "block_stride_elems": 0,
    }.items():
        setattr(sd, f, v)
    sd.dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    paged = [torch.randn(NB, NH, BS, HS2, generator=gen) for _ in range(NL)]
    return native, lmcache_op, sd, paged


def _call(fn, native, sd, paged, objs, ids, d2h, skip=0):
    direction = native.TransferDirection.D2H if d2h else native.TransferDirection.H2D
    fmt = native.EngineKVFormat(12)
    fn(paged, objs, ids, torch.device("cpu"), direction, sd, CHUNK, fmt, skip)


def _chunks(n):
    return [torch.empty(NL, CHUNK, NH * HS2) for _ in range(n)]


def test_a_faithful_round_trip_compares_every_restored_block() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()
    tap = KVTap(op=op, reference_op=op)
    tapped = tap.wrap()
    objs = _chunks(2)
    _call(tapped, native, sd, paged, objs, [0, 1, 2, 3], d2h=True)
    _call(tapped, native, sd, paged, objs, [6, 7, 8, 9], d2h=False, skip=1)
    assert tap.chunks_stored == 2
    assert tap.chunks_compared == 2
    assert tap.layer_blocks_compared == 3 * NL  # one block skipped
    assert tap.mismatches == []
    assert tap.chunks_unknown == 0
    assert torch.equal(paged[1][7], paged[1][1])


def test_a_broken_restore_is_named_by_chunk_and_block() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()
    tap = KVTap(op=op, reference_op=op, corrupt_restore=True)
    tapped = tap.wrap()
    objs = _chunks(2)
    _call(tapped, native, sd, paged, objs, [0, 1, 2, 3], d2h=True)
    before = paged[0][6].clone()
    _call(tapped, native, sd, paged, objs, [6, 7, 8, 9], d2h=False)
    assert not torch.equal(paged[0][6], before)  # flipped in the paged KV the engine reads
    (m,) = tap.mismatches
    assert (m.block, m.layer, m.differing_bytes) == (6, 0, 1)
    assert m.stored_as.startswith("store call 0, chunk 0 (blocks [0, 1]")
    assert tap.corrupted == [f"chunk {m.chunk} block 6 layer 0 byte 0"]


def test_a_store_that_differs_from_lmcaches_op_is_named() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()

    def off_by_one_block(paged_, objs, ids, *rest):  # a layout bug the same both ways
        op(paged_, objs, [(i + 1) % NB for i in ids], *rest)

    tap = KVTap(op=off_by_one_block, reference_op=op)
    _call(tap.wrap(), native, sd, paged, _chunks(2), [0, 1, 2, 3], d2h=True)
    assert tap.differential_chunks == 2
    assert tap.differential_mismatches == ["store call 0, chunk 0", "store call 0, chunk 1"]


def test_the_wrapper_keeps_the_annotation_lmcache_reads() -> None:
    from lmcache.v1.multiprocess.transfer_context.base import (
        _detect_block_transfer_accepts_tensor,
    )

    from kvactors_lmcache.ops import KvactorsCpuOps
    from kvactors_serving.tap import KVTap

    op = KvactorsCpuOps().multi_layer_block_kv_transfer
    assert _detect_block_transfer_accepts_tensor(op)
    wrapped = KVTap(op=op, reference_op=op).wrap()
    assert _detect_block_transfer_accepts_tensor(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(op)
