"""Reference and fast kernels (kvactors.kernels): examples, oracles, staged path, allocations."""

from __future__ import annotations

import dataclasses
import gc
import sys
import tracemalloc
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvactors.core.layouts import KVFormat
from kvactors.core.plan_cache import KernelMemo
from kvactors.core.plans import TransferPlan, plan_transfer
from kvactors.errors import TransferValidationError
from kvactors.kernels import fast
from kvactors.kernels.fast import ScratchCache, run_fast
from kvactors.kernels.reference import run_reference
from tests._transfer_cases import ALLOCS, Case, block_view, raw, same_bytes, snapshot

NHD = KVFormat.NL_X_TWO_NB_BS_NH_HS
HND = KVFormat.NL_X_TWO_NB_NH_BS_HS
MLA = KVFormat.NL_X_NB_BS_HS


def mk(fmt: KVFormat, **kw: Any) -> Case:
    base: dict[str, Any] = {
        "fmt": fmt,
        "nl": 3,
        "nb": 8,
        "bs": 2,
        "nh": 1 if fmt is MLA else 2,
        "hs": 4,
        "dtype": torch.bfloat16,
        "alloc": "stacked",
        "seed": 3,
        "n_objects": 2,
        "bpo": 3,
    }
    base.update(kw)
    return Case(**base)


def planned(c: Case, direction: int, ids: list[int], skip: int = 0) -> tuple[TransferPlan, Any]:
    paged, objs, backing = c.build()
    p = plan_transfer(c.request(direction, ids, skip), paged, objs, device_type="cpu")
    return p, (paged, objs, backing)


def both(c: Case, direction: int, ids: list[int], skip: int = 0, **fast_kw: Any) -> None:
    """Reference and fast path on identical operands leave identical bytes everywhere."""
    pa, (paged_a, objs_a, back_a) = planned(c, direction, ids, skip)
    pb, (paged_b, objs_b, back_b) = planned(c, direction, ids, skip)
    run_reference(pa, paged_a, objs_a)
    run_fast(pb, paged_b, objs_b, **fast_kw)
    assert same_bytes(back_a, back_b)
    assert same_bytes(objs_a, objs_b)


@pytest.mark.parametrize("fmt", list(KVFormat))
@pytest.mark.parametrize("alloc", ALLOCS)
@pytest.mark.parametrize("direction", [0, 1])
def test_fast_equals_reference(fmt: KVFormat, alloc: str, direction: int) -> None:
    c = mk(fmt, alloc=alloc)
    both(c, direction, [5, 0, 7, 2, 3, 6])  # full coverage
    both(c, direction, [5, 0, 7, 2], skip=1)  # skip + partial last object
    both(c, direction, [5, 0, 7, 2, 3, 6], staged=True)
    both(c, direction, [4, 1], skip=1, staged=True)


@pytest.mark.parametrize("fmt", [NHD, HND, KVFormat.TWO_X_NL_X_NB_BS_NH_HS])
def test_numpy_free_fallbacks_match(fmt: KVFormat) -> None:
    for alloc in ("stacked", "separate"):
        both(mk(fmt, alloc=alloc), 0, [5, 0, 7, 2, 3, 6], use_numpy=False)
        both(mk(fmt, alloc=alloc), 0, [5, 6, 7, 1], skip=2, use_numpy=False)


@pytest.mark.parametrize("fmt", [NHD, HND, MLA, KVFormat.TWO_X_NL_X_NB_BS_NH_HS])
@pytest.mark.parametrize("alloc", ["stacked", "gapped", "permuted", "separate"])
def test_numpy_free_gather_matches(fmt: KVFormat, alloc: str) -> None:
    # without numpy the host gather builds its rows index with torch (numpy otherwise) and
    # the per-plane paths use index_select instead of numpy take: the same bytes
    both(mk(fmt, alloc=alloc), 1, [5, 0, 7, 2, 3, 6], use_numpy=False)
    both(mk(fmt, alloc=alloc), 1, [5, 6, 7, 1], skip=2, use_numpy=False)


def test_reference_matches_lmcache_oracle_for_nhd() -> None:
    # LMCache's own oracle (test_engine_driven_device_dispatch.py::_assert_roundtrip).
    c = mk(NHD, n_objects=1, bpo=4)
    ids = [6, 1, 4, 2]
    p, (layers, objs, _) = planned(c, 1, ids)
    run_reference(p, layers, objs)
    idx = torch.tensor(ids)
    want = torch.stack([t[:, idx].reshape(2, len(ids) * c.bs, c.nh * c.hs) for t in layers], dim=1)
    assert torch.equal(raw(objs[0]), raw(want))


def test_reference_hnd_is_token_major() -> None:
    c = mk(HND, n_objects=1, bpo=2)
    p, (layers, objs, _) = planned(c, 1, [3, 5])
    run_reference(p, layers, objs)
    obj = objs[0].view(2, c.nl, 2, c.bs, c.nh, c.hs)
    for layer, t in enumerate(layers):
        for j, b in enumerate([3, 5]):
            # paged [p, b, h, s, d] -> obj [p, l, j, s, h, d]
            assert torch.equal(raw(obj[:, layer, j]), raw(t[:, b].transpose(1, 2)))


def _lmcache_transfer() -> Any:
    mod = pytest.importorskip("lmcache.v1.platform.torch_ops.mp_mem_kernels")
    return mod.multi_layer_block_kv_transfer


@pytest.mark.parametrize("fmt", list(KVFormat))
@pytest.mark.parametrize("direction", [0, 1])
def test_reference_matches_lmcache_torch_path(fmt: KVFormat, direction: int) -> None:
    op = _lmcache_transfer()
    native = pytest.importorskip("lmcache.lmcache_native")
    c = mk(fmt, alloc="gapped", dtype=torch.float32)
    ids, skip = [5, 0, 7, 2, 3], 1
    p, (paged_a, objs_a, back_a) = planned(c, direction, ids, skip)
    run_reference(p, paged_a, objs_a)
    paged_b, objs_b, back_b = c.build()
    sd = native.PageBufferShapeDesc()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(p.request.shape, f))
    sd.dtype = c.dtype
    op(
        paged_b, objs_b, list(ids), torch.device("cpu"), native.TransferDirection(direction),
        sd, c.bpo * c.bs, native.EngineKVFormat(int(fmt)), skip,
    )  # fmt: skip
    assert same_bytes(back_a, back_b)
    assert same_bytes(objs_a, objs_b)


@pytest.mark.parametrize("fmt", list(KVFormat))
def test_round_trip_to_new_blocks(fmt: KVFormat) -> None:
    # Gather blocks A, scatter into blocks B of a zeroed cache: B equals A, the rest stays 0.
    c = mk(fmt, n_objects=2, bpo=2)
    src_ids, dst_ids = [1, 6, 3, 0], [7, 2, 4, 5]
    p, (paged, objs, _) = planned(c, 1, src_ids)
    run_fast(p, paged, objs)
    zero = dataclasses.replace(c, seed=c.seed + 1)
    paged2, _, backing2 = zero.build()
    for t in backing2:
        t.zero_()
    p2 = plan_transfer(c.request(0, dst_ids), paged2, objs, device_type="cpu")
    run_fast(p2, paged2, objs)
    planes = c.spec.planes
    for layer in range(c.nl):
        for pl in range(planes):
            for b in range(c.nb):
                got = raw(block_view(fmt, paged2, c.nl, layer, pl, b))
                if b in dst_ids:
                    src = src_ids[dst_ids.index(b)]
                    assert torch.equal(got, raw(block_view(fmt, paged, c.nl, layer, pl, src)))
                else:
                    assert not got.any()


def test_d2h_leaves_uncovered_rows_and_objects_untouched() -> None:
    c = mk(NHD, n_objects=3, bpo=3)
    p, (paged, objs, backing) = planned(c, 1, [1, 2, 3, 4], skip=2)
    before, paged_before = snapshot(objs), snapshot(backing)
    run_fast(p, paged, objs)
    assert same_bytes(backing, paged_before)  # D2H never writes the paged memory
    rows = c.bs
    # object 0: slot 2 only; object 1: slot 0 only; object 2 untouched
    assert torch.equal(raw(objs[0])[:, :, : 2 * rows], before[0][:, :, : 2 * rows])
    assert not torch.equal(raw(objs[0])[:, :, 2 * rows :], before[0][:, :, 2 * rows :])
    assert torch.equal(raw(objs[1])[:, :, rows:], before[1][:, :, rows:])
    assert torch.equal(raw(objs[2]), before[2])


def test_h2d_does_not_read_skipped_rows_nor_write_other_blocks() -> None:
    c = mk(NHD, n_objects=2, bpo=2)
    p, (paged, objs, backing) = planned(c, 0, [7, 6, 5], skip=1)
    before = snapshot(backing)
    objs_before = snapshot(objs)
    run_fast(p, paged, objs)
    assert same_bytes(objs, objs_before)  # H2D never writes objects
    for layer in range(c.nl):
        for pl in range(2):
            # block 7 sat at the skipped position: untouched; 6 <- obj0 slot 1; 5 <- obj1 slot 0
            assert torch.equal(raw(block_view(NHD, paged, c.nl, layer, pl, 7)),
                               raw(block_view(NHD, [t.view_as(t) for t in _views(before, c)],
                                              c.nl, layer, pl, 7)))  # fmt: skip
            want6 = objs[0][pl, layer, c.bs : 2 * c.bs].view(c.bs, c.nh, c.hs)
            assert torch.equal(raw(block_view(NHD, paged, c.nl, layer, pl, 6)), raw(want6))


def _views(backing: list[torch.Tensor], c: Case) -> list[torch.Tensor]:
    shape = c.spec.tensor_shape(c.nl, c.nb, c.bs, c.nh, c.hs)
    n = torch.Size(shape).numel()
    return [backing[0][u * n : (u + 1) * n].view(shape) for u in range(c.nl)]


def test_rejected_plan_replay_on_other_tensors() -> None:
    c = mk(NHD)
    p, (paged, objs, _) = planned(c, 1, [0, 1])
    other, objs2, _ = c.build()
    with pytest.raises(TransferValidationError):
        run_fast(p, other, objs)
    with pytest.raises(TransferValidationError):
        run_reference(p, paged, objs2)


def test_staged_path_one_contiguous_copy_per_object_and_scratch_reuse() -> None:
    c = mk(NHD, n_objects=3, bpo=2)
    calls: list[tuple[bool, bool, int]] = []

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append((dst.is_contiguous(), src.is_contiguous(), dst.numel()))
        dst.copy_(src)

    scratch = ScratchCache()
    for direction in (1, 0, 1):
        p, (paged, objs, _) = planned(c, direction, [0, 1, 2, 3, 4, 5])
        run_fast(p, paged, objs, copy=copy, scratch=scratch, staged=True)
    assert len(calls) == 9
    assert all(dc and sc and n == objs[0].numel() for dc, sc, n in calls)
    assert scratch.allocations == 1
    assert len(scratch) == 1


def test_staged_partial_copies_only_covered_rows() -> None:
    c = mk(NHD, n_objects=2, bpo=3)
    seen: list[tuple[int, ...]] = []

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        seen.append(tuple(dst.shape))
        dst.copy_(src)

    both(c, 1, [0, 1, 2, 3], skip=1, copy=copy, staged=True)
    assert seen == [(2, c.nl, 2, c.bs, c.nh, c.hs), (2, c.nl, 1, c.bs, c.nh, c.hs)]


def test_staged_false_is_refused_for_device_tensors() -> None:
    c = mk(NHD)
    p, (paged, objs, _) = planned(c, 1, [0])
    fake = TransferPlan(**{**{f: getattr(p, f) for f in p.__struct_fields__}, "on_host": False})
    with pytest.raises(TransferValidationError):
        run_fast(fake, paged, objs, staged=False)


def _allocated_bytes(fn: Any) -> tuple[int, int]:
    """(largest torch allocation, python/numpy bytes allocated) while ``fn`` runs.

    torch's CPU allocator is invisible to tracemalloc, so torch allocations come from the
    profiler's memory events (one run); numpy registers its buffers with tracemalloc, which
    watches a second run without the profiler (whose own bookkeeping it would count).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    tracemalloc.start()
    try:
        fn()
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return max(sizes, default=0), py_peak


@pytest.mark.parametrize(
    ("fmt", "alloc"),
    [(NHD, "stacked"), (NHD, "separate"), (HND, "stacked"), (HND, "separate"),
     (MLA, "padded")],
)  # fmt: skip
@pytest.mark.parametrize("direction", [0, 1])
@pytest.mark.parametrize("staged", [False, True])
def test_hot_path_allocates_nothing_chunk_sized(
    fmt: KVFormat, alloc: str, direction: int, staged: bool
) -> None:
    mla = fmt is MLA
    c = mk(fmt, alloc=alloc, nl=4, nb=32, bs=16, nh=1 if mla else 4, hs=256 if mla else 64, bpo=8)
    ids = list(range(31, 7, -1))
    p, (paged, objs, _) = planned(c, direction, ids)
    scratch = ScratchCache()
    run_fast(p, paged, objs, scratch=scratch, staged=staged)  # warm: staging allocated here
    biggest, py_bytes = _allocated_bytes(
        lambda: run_fast(p, paged, objs, scratch=scratch, staged=staged)
    )
    chunk = objs[0].nbytes
    assert scratch.allocations == (1 if staged else 0)
    assert biggest < chunk // 16, (biggest, chunk)
    assert py_bytes < chunk // 16, (py_bytes, chunk)


@pytest.mark.parametrize("path", ["run_fast", "reused stacked first", "reused rows first"])
@pytest.mark.parametrize("alloc", ALLOCS)
@pytest.mark.parametrize("fmt", [NHD, HND, MLA, KVFormat.TWO_X_NL_X_NB_BS_NH_HS])
@pytest.mark.parametrize("direction", [0, 1])
def test_reused_plan_allocates_nothing_chunk_sized(
    fmt: KVFormat, alloc: str, direction: int, path: str
) -> None:
    """A plan run once through ``run_fast`` or as the kernel the runtime specialises once per
    cached plan (``reused_kernel``, in either order of preference) copies nothing
    chunk-sized either: no torch call may make a strided pool contiguous first (index_select
    on dim 1 does, for MLA pools with padded blocks or gapped layers)."""
    mla = fmt is MLA
    c = mk(fmt, alloc=alloc, nl=4, nb=32, bs=16, nh=1 if mla else 4, hs=256 if mla else 64, bpo=8)
    p, (paged, objs, _) = planned(c, direction, list(range(31, 7, -1)))
    if path == "run_fast":

        def call() -> None:
            run_fast(p, paged, objs, checked=True)

    else:
        first = 0 if "rows" in path else 1 << 62
        kernel = fast.reused_kernel(p, paged, objs, KernelMemo(), rows_first_bytes=first)

        def call() -> None:
            kernel(paged, objs)

    call()  # first use: views and index tensors are built here
    biggest, py_bytes = _allocated_bytes(call)
    chunk = objs[0].nbytes
    assert biggest < chunk // 16, (biggest, chunk)
    assert py_bytes < chunk // 16, (py_bytes, chunk)


@pytest.mark.parametrize("rows_first", [False, True])
@pytest.mark.parametrize("fmt", list(KVFormat))
@pytest.mark.parametrize("alloc", ALLOCS)
@pytest.mark.parametrize("direction", [0, 1])
def test_reused_kernel_matches_the_reference(
    fmt: KVFormat, alloc: str, direction: int, rows_first: bool
) -> None:
    """The kernel the runtime specialises once per cached plan (``reused_kernel``: the
    stacked gather, the rows path, or the general kernel, in either order of preference)
    moves exactly the reference's bytes on every call, and a plan of other block ids on the
    same operands (one memo: the binder decided by the first) moves its own blocks."""
    first = 0 if rows_first else 1 << 62
    c = mk(fmt, alloc=alloc)
    memo = KernelMemo()
    for ids in ([5, 0, 7, 2, 3, 6], [1, 4, 6, 7, 0, 5], [5, 0, 7, 2]):
        pa, (paged_a, objs_a, back_a) = planned(c, direction, ids)
        pb, (paged_b, objs_b, back_b) = planned(c, direction, ids)
        if len(ids) != 6:
            memo = KernelMemo()  # another request: another cache entry
        for call in range(2):
            if call:  # new bytes on the source side: a stale copy would show
                src_a, src_b = (back_a, back_b) if direction == 1 else (objs_a, objs_b)
                for ta, tb in zip(src_a, src_b, strict=True):
                    fresh = torch.randn(ta.shape).to(ta.dtype)
                    ta.copy_(fresh)
                    tb.copy_(fresh)
            run_reference(pa, paged_a, objs_a)
            fast.reused_kernel(pb, paged_b, objs_b, memo, rows_first_bytes=first)(paged_b, objs_b)
            assert same_bytes(back_a, back_b)
            assert same_bytes(objs_a, objs_b)
        assert memo.binder is not None


_ONE_CALL = [
    (fmt, alloc, direction)
    for fmt in (KVFormat.NL_X_NB_NH_BS_CS, KVFormat.NL_X_NB_BS_NH_CS, HND, NHD, MLA)
    for direction in (0, 1)
    for alloc in ("stacked", "gapped", "padded", "separate")
]


@pytest.mark.parametrize(("fmt", "alloc", "direction"), _ONE_CALL)
@pytest.mark.parametrize(("ids", "skip"), [([5, 0, 7, 2, 3, 6], 0), ([5, 0, 7, 2, 3, 6], 1),
                                           ([5, 0, 7, 2, 3], 0)])  # fmt: skip
def test_host_calls_take_the_one_call_paths(
    fmt: KVFormat,
    alloc: str,
    direction: int,
    ids: list[int],
    skip: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whole chunks, a skipped prefix block or a short last chunk, layers in one allocation or
    in separate ones: a host gather or scatter runs as one call per chunk (and paged tensor
    when the layers are separate), never through the per-segment paths of ``_moves`` (the
    cost an engine's small chunks pay per segment), and moves exactly the reference's
    bytes."""

    def per_segment(*_: Any, **__: Any) -> None:
        raise AssertionError("a per-segment path ran")

    monkeypatch.setattr(fast, "gather_segment", per_segment)
    monkeypatch.setattr(fast, "scatter_segment", per_segment)
    both(mk(fmt, alloc=alloc), direction, ids, skip)


def test_index_tensor_keeps_its_buffer() -> None:
    """The int64 index tensor built over an ``array`` buffer owns it: its values survive the
    caller dropping everything else."""
    import gc

    t = fast.index_tensor((5, 7, 2**40))
    gc.collect()
    assert t.dtype is torch.int64
    assert t.tolist() == [5, 7, 2**40]
    assert fast.index_tensor(()).numel() == 0


@pytest.mark.parametrize(
    ("direction", "frames"), [(1, ["bind", "gather"]), (0, ["bind_whole", "scatter"])]
)
def test_a_rebound_kernel_of_the_engine_shape_makes_no_helper_frame(
    direction: int, frames: list[str]
) -> None:
    """vLLM CPU's layout (format 12, layers of one allocation, whole chunks): binding other
    ids to a memo's binder and running the kernel are the binder's and the kernel's frames
    only (the stacked gather, the whole-chunk numpy scatter), and move the reference's
    bytes."""
    c = mk(KVFormat.NL_X_NB_NH_BS_CS, alloc="stacked", dtype=torch.float32)
    memo = KernelMemo()
    pa, (paged, objs, back) = planned(c, direction, [5, 0, 7, 2, 3, 6])
    fast.reused_kernel(pa, paged, objs, memo)(paged, objs)  # the binder, decided once
    pb = plan_transfer(c.request(direction, [1, 4, 6, 7, 0, 5]), paged, objs, device_type="cpu")
    ref_a, (ref_paged, ref_objs, ref_back) = planned(c, direction, [5, 0, 7, 2, 3, 6])
    ref_b = plan_transfer(
        c.request(direction, [1, 4, 6, 7, 0, 5]), ref_paged, ref_objs, device_type="cpu"
    )
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.append(frame.f_code.co_name)

    gc.collect()
    gc.disable()  # no collection (and no finalizer's frames) inside the window
    sys.setprofile(profile)
    try:
        fast.reused_kernel(pb, paged, objs, memo)(paged, objs)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert seen == ["reused_kernel", *frames]
    run_reference(ref_a, ref_paged, ref_objs)
    run_reference(ref_b, ref_paged, ref_objs)
    assert same_bytes(back, ref_back)
    assert same_bytes(objs, ref_objs)
