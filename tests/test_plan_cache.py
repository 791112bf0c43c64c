"""Plans validated once: an unchanged request reuses its plan, other block ids and chunk
buffers validate only those, every other change of the request or the operands' metadata
validates in full."""

from __future__ import annotations

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


def _operands() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    base = torch.randn(NL, 2, NB, BS, NH, HS).to(torch.bfloat16)
    return list(base.unbind(0)), [torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16)]


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
    "storage (per-layer views from a pointer)": _from_pointer,
    "in-place view op (same object)": _inplace_view,
    ".data assigned (same object, pointer)": _data_assigned,
}


REFUSED = (
    "stride",
    "shape",
    "dtype",
    "device",
    "in-place view op (same object)",
    ".data assigned (same object, pointer)",
)


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_of_an_operand_revalidates(change: str) -> None:
    cache = PlanCache("cpu", 0)
    paged, objs = _operands()
    req = _request()
    cache.plan(req, paged, objs)
    assert not _planned(cache, req, paged, objs)
    new_paged, new_objs = CHANGES[change](paged, objs)
    if change in REFUSED:
        # Operands the plan is not valid for are refused every time, never served stale.
        for _ in range(2):
            with pytest.raises(KvactorsError):
                cache.plan(req, new_paged, new_objs)
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
    # The key is the encoded request without its ids (plan_cache._without_ids, which names
    # each field) and the encoded ids: a field TransferRequest gains must be added there, and
    # to the changes above.
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
