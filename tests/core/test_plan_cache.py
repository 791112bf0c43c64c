"""Plans validated once: an unchanged request reuses its plan, other block ids and chunk
buffers validate only those, every other change of the request or the operands' metadata
validates in full."""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plan_cache import PlanCache
from kvactors.core.plans import TransferRequest
from kvactors.errors import KvactorsError, TransferValidationError
from kvactors.kernels.fast import run_fast
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    from collections.abc import Callable


NL, NB, BS, NH, HS = 2, 8, 4, 2, 8
T = 2 * BS
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


def _request(**kw: Any) -> TransferRequest:
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    args: dict[str, Any] = {
        "fmt": int(FMT),
        "direction": int(Direction.D2H),
        "block_ids": (3, 5),
        "chunk_size": T,
        "shape": shape,
    }
    args.update(kw)
    return TransferRequest(**args)


class _Sub(torch.Tensor):
    """A tensor subclass: operands of it are read by name and keyed with their class (not by
    torch.Tensor's own methods)."""


def _operands(sub: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    base = torch.randn(NL, 2, NB, BS, NH, HS).to(torch.bfloat16)
    obj = torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16)
    if sub:
        base, obj = base.as_subclass(_Sub), obj.as_subclass(_Sub)
    return list(base.unbind(0)), [obj]


def _planned(cache: PlanCache, req: TransferRequest, paged: Any, objs: Any) -> bool:
    """Whether this lookup validated (a miss) rather than reused a plan."""
    before = cache.misses
    cache.plan(req, paged, objs)
    return cache.misses == before + 1


def test_unchanged_request_reuses_its_plan() -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    req = _request()
    assert _planned(cache, req, paged, objs)
    assert not _planned(cache, req, paged, objs)
    # New list objects holding the same tensors are the same operands.
    assert not _planned(cache, _request(), list(paged), list(objs))
    assert cache.hits == 2


def _swap_object(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return paged, [torch.zeros_like(objs[0])]  # another data pointer and storage


def _set_storage(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    objs[0].set_(torch.zeros_like(objs[0]).untyped_storage(), 0, objs[0].shape, objs[0].stride())
    return paged, objs


def _offset_view(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    big = torch.zeros(objs[0].numel() + 8, dtype=objs[0].dtype)
    return paged, [big[8:].view(objs[0].shape)]  # another storage offset


def _own_storages(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same memory, pointers, shapes and strides, but each layer its own storage at offset
    # 0 instead of views at offsets of one allocation: the stacked plan no longer applies.
    own = [torch.from_numpy(p.view(torch.int16).numpy()).view(p.dtype) for p in paged]
    assert [t.data_ptr() for t in own] == [p.data_ptr() for p in paged]
    return own, objs


def _strides(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # Same shape and pointer, transposed block/token strides: must fail validation afresh.
    p0 = paged[0]
    st = list(p0.stride())
    st[2], st[3] = st[3], st[2]
    return [p0.as_strided(p0.shape, st), *paged[1:]], objs


def _shape(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return [p[:, : NB - 1] for p in paged], objs


def _dtype(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return [p.view(torch.float16) for p in paged], [o.view(torch.float16) for o in objs]


def _device(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in paged], objs


def _inplace_view(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same tensor object, pointer and storage offset; only its shape and strides move.
    objs[0].unsqueeze_(0)
    return paged, objs


def _data_assigned(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # ``t.data = ...`` keeps the object and its pointer: only the dtype changes.
    ptr = paged[0].data_ptr()
    paged[0].data = paged[0].view(torch.float16)
    assert paged[0].data_ptr() == ptr
    return paged, objs


def _from_pointer(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same pointers, storage offsets, shapes and strides, but each layer its own storage
    # made from the pool's pointer (as Runtime.tensor_from_ptr makes them), sized to reach
    # its own elements only: one view over the first layer's storage no longer covers them.
    base = paged[0].untyped_storage().data_ptr()
    with Runtime("cpu") as rt:
        views = [
            rt.tensor_from_ptr(base, p.shape, p.dtype, stride=p.stride(),
                               storage_offset=int(p.storage_offset()))
            for p in paged
        ]  # fmt: skip
    assert [v.data_ptr() for v in views] == [p.data_ptr() for p in paged]
    return views, objs


def _structure(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return tuple(paged), objs


def _chunk_inference(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same memory, pointer, shape, stride, dtype and device: only the inference flag
    # (and the chunk's storage object, which the key does not hold for chunks) differ.
    with torch.inference_mode():
        inf = torch.from_numpy(objs[0].view(torch.int16).numpy()).view(objs[0].dtype)
    assert inf.is_inference()
    assert inf.data_ptr() == objs[0].data_ptr()
    return paged, [inf]


def _paged_inference(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # Inference tensors over the same storage, offsets, shapes and strides: only the flag.
    with torch.inference_mode():
        inf = [
            torch.empty(0, dtype=p.dtype).set_(
                p.untyped_storage(), p.storage_offset(), p.shape, p.stride()
            )
            for p in paged
        ]
    assert all(t.is_inference() for t in inf)
    assert [t.untyped_storage()._cdata for t in inf] == [p.untyped_storage()._cdata for p in paged]
    return inf, objs


def _layer_offset(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The second layer over a storage starting one element later, at one offset less: the
    # same pointer, shape and stride; only its storage offset (and storage) differ.
    p1 = paged[1]
    base = p1.untyped_storage().data_ptr() + p1.element_size()
    with Runtime("cpu") as rt:
        v = rt.tensor_from_ptr(base, p1.shape, p1.dtype, stride=p1.stride(),
                               storage_offset=int(p1.storage_offset()) - 1)  # fmt: skip
    assert v.data_ptr() == p1.data_ptr()
    assert v.storage_offset() != p1.storage_offset()
    return [paged[0], v], objs


def _chunk_stride(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same pointer and shape, another stride of the chunk: refused (not contiguous).
    o = objs[0]
    t = o.view(*o.shape[:-2], o.shape[-1], o.shape[-2]).transpose(-1, -2)
    assert t.shape == o.shape
    assert t.stride() != o.stride()
    assert t.data_ptr() == o.data_ptr()
    return paged, [t]


def _chunk_shape(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return paged, [objs[0].view(2, NL, T // 2, 2 * NH * HS)]


def _chunk_dtype(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return paged, [objs[0].view(torch.float16)]


def _chunk_device(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    return paged, [torch.empty(objs[0].shape, dtype=objs[0].dtype, device="meta")]


def _chunk_shrunk(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The chunk's storage shrinks under it (same object, pointer, shape and stride).
    objs[0].untyped_storage().resize_(objs[0].untyped_storage().nbytes() // 2)
    return paged, objs


def _plain(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The other tensor class (plain <-> subclass), every fact the same.
    def other(t: torch.Tensor) -> torch.Tensor:
        return t.as_subclass(torch.Tensor if type(t) is _Sub else _Sub)

    return [other(p) for p in paged], [other(o) for o in objs]


def _nest(paged: list[torch.Tensor], objs: list[torch.Tensor]) -> tuple[Any, Any]:
    # The same tensors in another structure: the chunks' list nested once more.
    return paged, [objs]


CHANGES: dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], tuple[Any, Any]]] = {
    "data pointer and storage": _swap_object,
    "storage (set_)": _set_storage,
    "storage offset": _offset_view,
    "storage offset, same pointers": _own_storages,
    "stride": _strides,
    "shape": _shape,
    "dtype": _dtype,
    "device": _device,
    "structure": _structure,
    "structure (nested chunks)": _nest,
    "tensor class": _plain,
    "chunk inference flag": _chunk_inference,
    "paged inference flag": _paged_inference,
    "storage offset of a layer, same pointer": _layer_offset,
    "chunk stride": _chunk_stride,
    "chunk shape": _chunk_shape,
    "chunk dtype": _chunk_dtype,
    "chunk device": _chunk_device,
    "chunk storage shrunk": _chunk_shrunk,
    "storage (per-layer views from a pointer)": _from_pointer,
    "in-place view op (same object)": _inplace_view,
    ".data assigned (same object, pointer)": _data_assigned,
}


def _memory(t: torch.Tensor) -> torch.Tensor:
    """A copy of the bytes of ``t``'s whole storage (whatever its metadata became)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


REFUSED = (
    "stride",
    "shape",
    "dtype",
    "device",
    "in-place view op (same object)",
    ".data assigned (same object, pointer)",
    "structure (nested chunks)",
    "chunk stride",
    "chunk shape",
    "chunk dtype",
    "chunk device",
    "chunk storage shrunk",
)


@pytest.mark.parametrize("sub", [False, True], ids=["plain", "subclass"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_of_an_operand_revalidates(change: str, sub: bool) -> None:
    """Each fact of the key, changed alone (on plain tensors: the lookup's flat path; on a
    subclass: its general path), validates afresh; a change the plan is not valid for
    raises exactly what a full validation raises, every time, before any memory is
    touched."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands(sub)
    req = _request()
    cache.plan(req, paged, objs)
    assert not _planned(cache, req, paged, objs)
    objs[0].fill_(7)  # what the D2H would overwrite
    kept = [*paged, *objs]
    before = [_memory(t) for t in kept]
    new_paged, new_objs = CHANGES[change](paged, objs)
    if change in REFUSED:
        with pytest.raises(KvactorsError) as full:
            _full(req, new_paged, new_objs)
        # Operands the plan is not valid for are refused every time, never served stale.
        for _ in range(2):
            with pytest.raises(KvactorsError) as refused:
                cache.plan(req, new_paged, new_objs)
            assert type(refused.value) is type(full.value)
            assert str(refused.value) == str(full.value)
        if change != "chunk storage shrunk":  # (that chunk's memory is gone)
            assert all(torch.equal(a, _memory(t)) for a, t in zip(before, kept, strict=True))
    else:
        assert _planned(cache, req, new_paged, new_objs)
        assert not _planned(cache, req, new_paged, new_objs)
        # And the plan is the one a full validation makes of the changed operands.
        assert cache.plan(req, new_paged, new_objs) == _full(req, new_paged, new_objs)


@pytest.mark.parametrize(
    "change",
    [
        {"block_ids": (3, 6)},
        {"direction": int(Direction.H2D)},
        {"skip_blocks": 1},
        {"chunk_size": 2 * T},
        {"fmt": int(KVFormat.NL_X_NB_TWO_BS_NH_HS)},
        {"shape": ShapeDesc(kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2,
                            dtype="float16")},
    ],
)  # fmt: skip
def test_every_change_of_the_request_revalidates(change: dict[str, Any]) -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(), paged, objs)
    try:
        planned = _planned(cache, _request(**change), paged, objs)
    except KvactorsError:
        planned = True  # validated, and refused
    assert planned


def test_every_request_field_is_in_the_key() -> None:
    # The key holds the encoded request without its ids (PlanCache.lookup's ``head``, which
    # names each field) and the encoded ids pick the plan: a field TransferRequest gains must
    # be added there, and to the changes above.
    assert set(TransferRequest.__struct_fields__) == {
        "fmt", "direction", "block_ids", "chunk_size", "skip_blocks", "shape",
    }  # fmt: skip


def test_bool_or_float_fields_never_hit_an_int_request_plan() -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(), paged, objs)
    with pytest.raises(KvactorsError):
        cache.plan(_request(direction=True), paged, objs)  # True == 1, but not an int
    with pytest.raises(KvactorsError):
        cache.plan(_request(block_ids=(3.0, 5)), paged, objs)


def test_failed_validation_is_never_cached() -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    bad = _request(block_ids=(3, NB))
    for _ in range(2):
        with pytest.raises(TransferValidationError):
            cache.plan(bad, paged, objs)
    assert len(cache) == 0


def test_cache_is_bounded() -> None:
    cache = PlanCache("cpu", 0, capacity=3)
    paged, objs = _operands()
    for k in range(1, 6):  # five requests (other block counts), one entry each
        cache.plan(_request(block_ids=tuple(range(k))), paged, objs)
    assert len(cache) == 3
    assert _planned(cache, _request(block_ids=(0,)), paged, objs)  # evicted first


def test_a_write_to_the_operands_keeps_the_plan() -> None:
    """No plan depends on data: writes (the engine's, another transfer's) change nothing."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    req = _request()
    plan = cache.plan(req, paged, objs)
    paged[1].add_(1)
    objs[0].zero_()
    assert not _planned(cache, req, paged, objs)
    assert cache.plan(req, paged, objs) is plan


def test_runtime_transfers_reuse_plans() -> None:
    paged, objs = _operands()
    req = _request()
    with Runtime("cpu") as rt:
        rt.transfer(req, paged, objs)
        validated = rt.statistics().plans_validated
        for _ in range(3):
            rt.transfer(req, paged, objs)
        objs[0].fill_(0)
        rt.transfer(req, paged, objs)
        assert rt.statistics().plans_validated == validated
        rt.transfer(_request(block_ids=(6, 1)), paged, objs)
        stats = rt.statistics()
        assert (stats.plans_validated, stats.plans_rebound) == (validated + 1, 1)


def _full(req: TransferRequest, paged: Any, objs: Any) -> Any:
    from kvactors.core.plans import plan_transfer

    return plan_transfer(req, paged, objs, device_type="cpu", device_index=0)


@pytest.mark.parametrize("direction", [int(Direction.D2H), int(Direction.H2D)])
def test_new_block_ids_on_the_same_operands_validate_only_the_ids(direction: int) -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(direction=direction), paged, objs)
    for ids in [(6, 1), (0, 7), (2, 2)] if direction == int(Direction.D2H) else [(6, 1), (0, 7)]:
        req = _request(direction=direction, block_ids=ids)
        assert _planned(cache, req, paged, objs)
        # Exactly the plan a full validation makes (ids, touched blocks, everything else).
        assert cache.plan(req, paged, objs) == _full(req, paged, objs)
    assert cache.rebinds == cache.misses - 1
    # A rebound plan moves the new ids' blocks.
    req = _request(direction=direction, block_ids=(6, 1))
    found = cache.lookup(req, paged, objs)
    assert found.memo is not None
    plan = found.plan
    assert plan.request.block_ids == (6, 1)
    expect = [p.clone() for p in paged], [o.clone() for o in objs]
    run_fast(_full(req, *expect), *expect)
    run_fast(plan, paged, objs)
    assert all(torch.equal(a, b) for a, b in zip(paged, expect[0], strict=True))
    assert torch.equal(objs[0], expect[1][0])


@pytest.mark.parametrize(
    ("ids", "direction", "error"),
    [
        ((3, NB), int(Direction.D2H), TransferValidationError),
        ((-1, 3), int(Direction.D2H), TransferValidationError),
        ((True, 3), int(Direction.D2H), KvactorsError),
        ((4, 4), int(Direction.H2D), TransferValidationError),
    ],
)
def test_bad_new_block_ids_fail_as_a_full_validation_does(
    ids: tuple[Any, ...], direction: int, error: type[Exception]
) -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(direction=direction), paged, objs)
    bad = _request(direction=direction, block_ids=ids)
    with pytest.raises(error) as raised:
        _full(bad, paged, objs)
    for _ in range(2):  # the same error as plan_transfer's, every time, nothing cached
        with pytest.raises(error) as again:
            cache.plan(bad, paged, objs)
        assert str(again.value) == str(raised.value)
    assert cache.rebinds == 0
    assert len(cache) == 1


def test_inference_tensors_reuse_plans_and_still_revalidate_on_changes() -> None:
    with torch.inference_mode():
        paged, objs = _operands()
    cache = PlanCache("cpu", 0)
    req = _request()
    found = cache.lookup(req, paged, objs)
    assert found.inference
    with torch.inference_mode():
        run_fast(found.plan, paged, objs)
    assert not _planned(cache, req, paged, objs)
    assert _planned(cache, req, [p.clone() for p in paged], objs)  # other pointers
    with pytest.raises(TransferValidationError):  # another dtype: validated, and refused
        cache.plan(req, paged, [objs[0].view(torch.float16)])


def test_runtime_moves_inference_tensors() -> None:
    with torch.inference_mode():
        paged, objs = _operands()
    with Runtime("cpu") as rt:
        for _ in range(2):
            rt.transfer(_request(), paged, objs)
    expect = torch.stack([p[:, [3, 5]] for p in paged], 1).reshape(objs[0].shape)
    assert objs[0].abs().sum() > 0
    assert torch.equal(objs[0], expect)


def test_inference_tensors_through_the_mailbox_route() -> None:
    with torch.inference_mode():
        paged, objs = _operands()
    with Runtime("cpu") as rt:
        rt.transfer(_request(), paged, objs)
    expect = torch.stack([p[:, [3, 5]] for p in paged], 1).reshape(objs[0].shape)
    assert torch.equal(objs[0], expect)


@pytest.mark.parametrize("direction", [int(Direction.D2H), int(Direction.H2D)])
def test_other_chunk_buffers_of_a_layout_validate_only_ids_and_addresses(direction: int) -> None:
    """Chunk buffers of the planned layout at other addresses (another allocation, views at
    other offsets of one pool) are rebound, not validated in full: exactly the plan a full
    validation makes, their own data pointers included."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(direction=direction), paged, objs)
    o = objs[0]
    pool = torch.zeros(3 * o.numel() + 5, dtype=o.dtype)
    buffers = [
        [torch.zeros_like(o)],
        [pool[5 : 5 + o.numel()].view(o.shape)],
        [pool[5 + 2 * o.numel() :].view(o.shape)],
    ]
    for bufs, ids in zip(buffers, [(6, 1), (0, 7), (2, 4)], strict=True):
        req = _request(direction=direction, block_ids=ids)
        assert _planned(cache, req, paged, bufs)
        assert cache.plan(req, paged, bufs) == _full(req, paged, bufs)
    assert cache.rebinds == cache.misses - 1 == 3


def test_entries_do_not_grow_with_the_chunk_buffers_a_pool_hands_out() -> None:
    """Every call into another chunk buffer of the same layout finds the one entry."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    for k in range(12):
        bufs = [torch.zeros_like(objs[0])]
        cache.plan(_request(block_ids=(k % NB, (k + 3) % NB)), paged, bufs)
    assert len(cache) == 1
    assert cache.rebinds == 11


def test_a_chunk_without_storage_facts_fails_as_a_full_validation_does() -> None:
    """A sparse chunk has no data pointer or storage to key: validated, and refused with
    ``plan_transfer``'s own error (not the fact reader's)."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    req = _request()
    cache.plan(req, paged, objs)
    sparse = [objs[0].to_sparse()]
    with pytest.raises(KvactorsError) as full:
        _full(req, paged, sparse)
    with pytest.raises(KvactorsError) as refused:
        cache.plan(req, paged, sparse)
    assert (type(refused.value), str(refused.value)) == (type(full.value), str(full.value))


@pytest.mark.parametrize("direction", [int(Direction.D2H), int(Direction.H2D)])
def test_a_rebind_of_plain_operands_is_one_python_frame(direction: int) -> None:
    """Other ids and other chunk buffers of a cached layout (the engine's steady state): the
    lookup reads the facts and rebinds the ids in its own frame, calling no Python helper."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    cache.plan(_request(direction=direction), paged, objs)
    req, other = _request(direction=direction, block_ids=(6, 1)), [torch.zeros_like(objs[0])]
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)

    gc.collect()
    gc.disable()  # no collection (and no finalizer's frames) inside the window
    sys.setprofile(profile)
    try:
        found = cache.lookup(req, paged, other)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert frames == ["lookup"]
    assert cache.rebinds == 1
    assert found.plan == _full(req, paged, other)


class _Counted(torch.Tensor):
    """A subclass answering every torch call in Python (as a fake device's tensors do),
    counting them; its ``device`` is a Python property."""

    calls: int = 0
    placed = "cpu"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _Counted.calls += 1
        return super().__torch_function__(func, types, args, kwargs)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device(_Counted.placed)


def test_a_rebind_of_subclass_operands_runs_no_torch_function() -> None:
    """The key's facts are read with torch function dispatch off: a subclass answering torch
    calls in Python costs no call of its ``__torch_function__`` and no Python frame but the
    lookup's on a warm lookup (other ids, other chunks), while its Python properties are
    still read (a changed device misses)."""
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    paged = [p.as_subclass(_Counted) for p in paged]
    objs = [o.as_subclass(_Counted) for o in objs]
    req = _request()
    assert _planned(cache, req, paged, objs)
    other = [torch.zeros_like(objs[0]).as_subclass(_Counted)]
    again = _request(block_ids=(6, 1))
    _Counted.calls = 0
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            frames.append(frame.f_code.co_name)

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        found = cache.lookup(again, paged, other)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert _Counted.calls == 0
    # One frame of the lookup's own (lists of one tensor class: no structure walk), and the
    # subclass's Python property per tensor.
    assert [f for f in frames if f != "device"] == ["lookup"]
    assert frames.count("device") == len(paged) + len(other)
    assert cache.rebinds == 1
    assert found.plan == _full(again, paged, other)
    _Counted.placed = "meta"  # a fact only the Python property answers
    try:
        with pytest.raises(KvactorsError) as full:
            _full(req, paged, objs)
        with pytest.raises(KvactorsError) as refused:
            cache.plan(req, paged, objs)
        assert str(refused.value) == str(full.value)
    finally:
        _Counted.placed = "cpu"


def test_one_cross_layer_tensor_with_subclass_chunks_is_keyed_as_one_unit() -> None:
    """A cross-layer pool (one plain tensor) with chunks of a tensor subclass: the pool is
    one unit of the key (not iterated), so a call with other ids rebinds the kept plan."""
    cache = PlanCache("cpu", 0)
    paged = torch.randn(NB, NL, 2, BS, NH, HS).to(torch.bfloat16)
    objs = [torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16).as_subclass(_Sub)]
    fmt = int(KVFormat.NB_NL_TWO_BS_NH_HS)
    for ids in ((3, 5), (6, 1), (3, 5)):
        found = cache.lookup(_request(fmt=fmt, block_ids=ids), paged, objs)
        assert found.plan == _full(_request(fmt=fmt, block_ids=ids), paged, objs)
    assert (cache.hits, cache.misses, cache.rebinds) == (0, 3, 2)
