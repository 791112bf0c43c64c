"""Validation and planning (kvactors.core.plans): contract 3.1 order and types, 3.2 semantics."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
import torch

from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.core.plans import (
    TransferPlan,
    TransferRequest,
    plan_transfer,
    segments_for,
)
from kvactors.errors import OperandTypeError, TransferValidationError
from tests._transfer_cases import Case

NHD = KVFormat.NL_X_TWO_NB_BS_NH_HS
MLA = KVFormat.NL_X_NB_BS_HS
KVL = KVFormat.TWO_X_NL_X_NB_BS_NH_HS
CROSS = KVFormat.NB_NL_TWO_BS_NH_HS


def case(fmt: KVFormat = NHD, **kw: Any) -> Case:
    base: dict[str, Any] = {
        "fmt": fmt,
        "nl": 2,
        "nb": 6,
        "bs": 2,
        "nh": 1 if fmt is MLA else 2,
        "hs": 4,
        "dtype": torch.bfloat16,
        "alloc": "stacked",
        "seed": 1,
        "n_objects": 2,
        "bpo": 2,
    }
    base.update(kw)
    return Case(**base)


def plan(c: Case, direction: int = 1, ids: list[int] | None = None, **req: Any) -> TransferPlan:
    paged, objs, _ = c.build()
    r = c.request(direction, [0, 1, 2, 3] if ids is None else ids)
    return plan_transfer(msgspec.structs.replace(r, **req), paged, objs, device_type="cpu")


def with_shape(r: TransferRequest, **fields: Any) -> TransferRequest:
    return msgspec.structs.replace(r, shape=msgspec.structs.replace(r.shape, **fields))


# -- segments (contract 3.2) -------------------------------------------------------------------


def test_segments_full_coverage() -> None:
    segs = segments_for(n_objects=2, block_ids_len=4, bpo=2, skip=0, bs=16)
    assert [(s.obj, s.row0, s.slot0, s.start, s.stop) for s in segs] == [
        (0, 0, 0, 0, 2),
        (1, 0, 0, 2, 4),
    ]


def test_segments_skip_and_partial_last_object() -> None:
    segs = segments_for(n_objects=3, block_ids_len=7, bpo=3, skip=4, bs=2)
    # object 0 fully skipped, object 1 from slot 1, object 2 only slot 0
    assert [(s.obj, s.row0, s.slot0, s.start, s.stop) for s in segs] == [
        (1, 2, 1, 4, 6),
        (2, 0, 0, 6, 7),
    ]


def test_segments_ignore_ids_beyond_objects_and_empty_objects() -> None:
    assert [s.stop for s in segments_for(1, 10, 2, 0, 1)] == [2]
    assert segments_for(3, 2, 2, 0, 1)[-1].obj == 0
    assert segments_for(2, 4, 2, 9, 1) == ()


def test_plan_touched_blocks_and_nbytes() -> None:
    c = case(n_objects=2, bpo=2)
    p = plan(c, ids=[5, 3, 1, 0, 4], skip_blocks=1)
    assert p.touched_blocks == frozenset({3, 1, 0})
    plane = c.bs * c.nh * c.hs * 2
    assert p.nbytes == 3 * plane * 2 * c.nl
    assert [s.count for s in p.segments] == [1, 2]


def test_plan_holds_no_tensors_and_request_is_wire_safe() -> None:
    p = plan(case())

    def walk(v: Any) -> None:
        assert not isinstance(v, torch.Tensor)
        if isinstance(v, msgspec.Struct):
            for f in v.__struct_fields__:
                walk(getattr(v, f))
        elif isinstance(v, (tuple, list, frozenset)):
            for x in v:
                walk(x)

    walk(p)
    r = p.request
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=TransferRequest) == r


@pytest.mark.parametrize(
    ("alloc", "stacked", "tight"),
    [("stacked", True, True), ("gapped", True, True), ("separate", False, True),
     ("shuffled", False, True)],
)  # fmt: skip
def test_layout_facts(alloc: str, stacked: bool, tight: bool) -> None:
    p = plan(case(alloc=alloc))
    assert (p.stacked is not None) is stacked
    assert p.tight is tight
    assert (p.rows is not None) is (stacked and tight)


def test_hnd_is_never_tight_and_padded_mla_rows_geometry() -> None:
    assert not plan(case(KVFormat.NL_X_TWO_NB_NH_BS_HS)).tight
    p = plan(case(MLA, alloc="padded", declare_stride=True))
    assert p.rows is not None
    assert p.rows.piece == 2 * 4
    assert p.rows.block_rows * p.rows.row_stride == 2 * 4 + 3


def test_reversed_layers_are_not_stacked() -> None:
    c = case(nl=3)
    paged, objs, _ = c.build()
    p = plan_transfer(c.request(1, [0]), list(reversed(paged)), objs, device_type="cpu")
    assert p.stacked is None


# -- validation order and exception types (contract 3.1) ---------------------------------------


def _err(c: Case, mutate: Any, paged: Any = None, objs: Any = None, **kw: Any) -> BaseException:
    p0, o0, _ = c.build()
    r = mutate(c.request(kw.pop("direction", 1), kw.pop("ids", [0, 1, 2])))
    with pytest.raises((TransferValidationError, OperandTypeError)) as ei:
        plan_transfer(
            r, p0 if paged is None else paged, o0 if objs is None else objs,
            device_type=kw.pop("device_type", "cpu"), **kw,
        )  # fmt: skip
    return ei.value


def check(exc: BaseException, kind: type[BaseException], field: str) -> None:
    assert isinstance(exc, kind), exc
    assert getattr(exc, "field", None) == field, (exc, getattr(exc, "field", None))


def test_chunk_size_first() -> None:
    c = case()
    e = _err(
        c, lambda r: with_shape(msgspec.structs.replace(r, chunk_size=0, skip_blocks=-1), bs=0)
    )
    check(e, ValueError, "chunk_size")
    e = _err(c, lambda r: msgspec.structs.replace(r, chunk_size=5, skip_blocks=-1))
    check(e, ValueError, "bs")
    e = _err(c, lambda r: with_shape(msgspec.structs.replace(r, skip_blocks=-1), bs=0))
    check(e, ValueError, "bs")


def test_skip_then_direction_then_format() -> None:
    c = case()
    e = _err(c, lambda r: msgspec.structs.replace(r, skip_blocks=-1, direction=5, fmt=4))
    check(e, ValueError, "skip_blocks")
    e = _err(c, lambda r: msgspec.structs.replace(r, direction=2, fmt=4))
    check(e, ValueError, "direction")
    e = _err(c, lambda r: msgspec.structs.replace(r, fmt=4))
    check(e, ValueError, "fmt")
    e = _err(c, lambda r: msgspec.structs.replace(r, fmt=17))
    check(e, ValueError, "fmt")


def test_dtype_before_structure() -> None:
    c = case()
    e = _err(c, lambda r: with_shape(r, dtype="complex64"), paged="not a list")
    check(e, ValueError, "dtype")
    e = _err(c, lambda r: with_shape(r, dtype="float16"), paged="not a list")
    check(e, TypeError, "paged")  # a known dtype passes step 3; the tensors are checked later
    check(_err(c, lambda r: with_shape(r, dtype="float16")), ValueError, "dtype")
    e = _err(c, lambda r: with_shape(r, dtype="float32"))
    check(e, ValueError, "element_size")


def test_two_byte_element_without_dtype_or_tensors_is_rejected() -> None:
    c = case()
    e = _err(c, lambda r: with_shape(r, dtype=None), paged=[], objs=[])
    check(e, ValueError, "dtype")
    # with tensors the dtype comes from them (fp16 is never guessed)
    paged, objs, _ = c.build()
    p = plan_transfer(with_shape(c.request(1, [0]), dtype=None), paged, objs, device_type="cpu")
    assert p.dtype == "bfloat16"


def test_one_and_four_byte_sizes_without_tensors_resolve_then_fail_on_counts() -> None:
    c = case(dtype=torch.float32)
    e = _err(c, lambda r: with_shape(r, dtype=None), paged=[], objs=[])
    check(e, ValueError, "nl")


@pytest.mark.parametrize(
    ("fmt", "paged", "field"),
    [
        (NHD, "x", "paged"),
        (NHD, torch.zeros(2), "paged"),
        (NHD, [torch.zeros(1), 3], "paged"),
        (CROSS, [torch.zeros(1)], "paged"),
        (KVL, torch.zeros(2), "paged"),
        (KVL, [[torch.zeros(1)], [3]], "paged"),
    ],
)
def test_paged_structure_is_type_error(fmt: KVFormat, paged: Any, field: str) -> None:
    c = case(fmt, dtype=torch.float32)
    check(_err(c, lambda r: r, paged=paged), TypeError, field)


def test_kv_list_flat_odd_and_unequal_lists_are_value_errors() -> None:
    c = case(KVL)
    paged, _, _ = c.build()
    flat = list(paged[0]) + list(paged[1]) if isinstance(paged[0], list) else list(paged)
    check(_err(c, lambda r: r, paged=flat[:3]), ValueError, "paged")
    check(_err(c, lambda r: r, paged=[flat[:2], flat[2:3]]), ValueError, "paged")


def test_kv_list_accepts_nested_and_flat() -> None:
    c = case(KVL)
    paged, objs, _ = c.build()
    flat = list(paged[0]) + list(paged[1]) if isinstance(paged[0], list) else list(paged)
    nested = [flat[: c.nl], flat[c.nl :]]
    for form in (flat, nested, tuple(flat)):
        p = plan_transfer(c.request(1, [0]), form, objs, device_type="cpu")
        assert p.stacked is not None


@pytest.mark.parametrize("objs", ["x", torch.zeros(2), [torch.zeros(1), None]])
def test_objects_structure_is_type_error(objs: Any) -> None:
    check(_err(case(), lambda r: r, objs=objs), TypeError, "objects")


def test_layer_count_mismatch() -> None:
    c = case(nl=3)
    paged, _, _ = c.build()
    check(_err(c, lambda r: r, paged=paged[:2]), ValueError, "nl")
    check(_err(c, lambda r: with_shape(r, nl=2)), ValueError, "nl")
    check(_err(case(CROSS), lambda r: with_shape(r, nl=3)), ValueError, "shape")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kv_size": 1}, "kv_size"),
        ({"nb": 0}, "nb"),
        ({"nh": 3}, "shape"),
        ({"hs": 5}, "shape"),
        ({"block_stride_elems": 64}, "block_stride_elems"),
        ({"element_size": True}, "element_size"),
    ],
)
def test_shape_desc_mismatches(fields: dict[str, Any], field: str) -> None:
    e = _err(case(), lambda r: with_shape(r, **fields))
    assert isinstance(e, (ValueError, TypeError))
    assert e.field == field  # type: ignore[union-attr]


def test_mla_needs_one_head_and_matching_block_stride() -> None:
    c = case(MLA, alloc="padded", declare_stride=True)
    check(_err(c, lambda r: with_shape(r, nh=2)), ValueError, "nh")
    check(_err(c, lambda r: with_shape(r, block_stride_elems=99)), ValueError,
          "block_stride_elems")  # fmt: skip
    assert plan(c).stacked is not None
    # block_stride_elems=0 takes the stride from the (padded) tensors
    p = plan(c, shape=with_shape(c.request(1, [0]), block_stride_elems=0).shape)
    assert p.rows is not None


def test_tensor_dtype_device_and_overlap() -> None:
    c = case()
    paged, _, _ = c.build()
    check(_err(c, lambda r: r, paged=[t.half() for t in paged]), ValueError, "dtype")
    check(_err(c, lambda r: r, device_type="mlu"), ValueError, "device")
    expanded = [t[:, :1].expand(t.shape) for t in paged]
    check(_err(c, lambda r: r, paged=expanded), ValueError, "paged")


def test_objects_value_checks() -> None:
    c = case()
    _, objs, _ = c.build()
    bad_dtype = [o.half() for o in objs]
    check(_err(c, lambda r: r, objs=bad_dtype), ValueError, "dtype")
    wrong = [o[:, :, :2] for o in objs]
    check(_err(c, lambda r: r, objs=wrong), ValueError, "objects")
    noncontig = [o.transpose(0, 1).contiguous().transpose(0, 1) for o in objs]
    check(_err(c, lambda r: r, objs=noncontig), ValueError, "objects")
    meta = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in objs]
    check(_err(c, lambda r: r, objs=meta), ValueError, "objects")


def test_mla_objects_accept_leading_one() -> None:
    p = plan(case(MLA, mla_4d=True))
    assert len(p.segments) == 2


@pytest.mark.parametrize(
    ("ids", "kind", "direction"),
    [
        ([0, 6], ValueError, 1),
        ([-1], ValueError, 1),
        ([0, True], TypeError, 1),
        ([1, 2, 1], ValueError, 0),
    ],
)
def test_block_ids(ids: list[Any], kind: type[BaseException], direction: int) -> None:
    check(_err(case(), lambda r: r, ids=ids, direction=direction), kind, "block_ids")


def test_duplicates_allowed_on_d2h_and_outside_coverage_on_h2d() -> None:
    assert plan(case(), direction=1, ids=[1, 2, 1]).touched_blocks == frozenset({1, 2})
    p = plan(case(n_objects=1), direction=0, ids=[1, 2, 1])  # third id is not covered
    assert p.touched_blocks == frozenset({1, 2})
    p = plan(case(), direction=0, ids=[1, 2, 1], skip_blocks=1)  # first one skipped
    assert p.touched_blocks == frozenset({1, 2})


def test_non_int_request_fields_are_type_errors() -> None:
    check(_err(case(), lambda r: msgspec.structs.replace(r, chunk_size=4.0)), TypeError,
          "chunk_size")  # fmt: skip
    check(_err(case(), lambda r: msgspec.structs.replace(r, direction=None)), TypeError,
          "direction")  # fmt: skip
    with pytest.raises(OperandTypeError):
        plan_transfer("req", [], [], device_type="cpu")  # type: ignore[arg-type]


def test_device_index_checked() -> None:
    c = case()
    paged, objs, _ = c.build()
    plan_transfer(c.request(1, [0]), paged, objs, device_type="cpu", device_index=0)
    check(_err(c, lambda r: r, device_index=1), ValueError, "device")


def test_case_dataclass_is_cheap_to_vary() -> None:
    c = dataclasses.replace(case(), nb=3)
    assert plan(c, ids=[0, 1, 2]).request.shape == ShapeDesc(
        kv_size=2, nl=2, nb=3, bs=2, nh=2, hs=4, element_size=2, dtype="bfloat16"
    )


# -- fused K/V formats (10-13: one plane of NH heads, the packed width 2*HS) -------------------

FUSED_HND = KVFormat.NL_X_NB_NH_BS_CS


def test_fused_shape_desc_and_objects() -> None:
    p = plan(case(FUSED_HND, hs=8))
    assert (p.spec.planes, p.tight, p.stacked is not None) == (1, False, True)
    assert p.nbytes == 4 * 2 * 2 * 8 * 2 * 2  # blocks * bs * nh * hs * itemsize * nl
    with pytest.raises(TransferValidationError, match="kv_size=1") as e:
        plan(
            case(FUSED_HND, hs=8),
            shape=with_shape(case(FUSED_HND).request(1, [0]), kv_size=2).shape,
        )
    assert e.value.field == "kv_size"
    c = case(FUSED_HND, hs=8)
    paged, _, _ = c.build()
    split_objs = [torch.zeros(2, c.nl, c.bpo * c.bs, c.nh * c.hs // 2, dtype=c.dtype)] * 2
    with pytest.raises(TransferValidationError, match="object 0 has shape") as e:
        plan_transfer(c.request(1, [0, 1]), paged, split_objs, device_type="cpu")
    assert e.value.field == "objects"


def test_fused_split_width_form_is_the_same_plan() -> None:
    packed, split = plan(case(FUSED_HND, hs=8)), plan(case(FUSED_HND, hs=8, split_width=True))
    assert split.stacked is not None
    assert (split.stacked, split.tight, split.nbytes) == (
        packed.stacked,
        packed.tight,
        packed.nbytes,
    )


def test_fused_split_width_that_is_not_one_run_is_refused() -> None:
    c = case(FUSED_HND, hs=8)
    _, objs, _ = c.build()
    # [2, NB, NH, BS, HS/2] memory seen as [NB, NH, BS, 2, HS/2]: K and V are not one run.
    base = torch.zeros(2, c.nb, c.nh, c.bs, c.hs // 2, dtype=c.dtype)
    layers = [base.permute(1, 2, 3, 0, 4)] * c.nl
    with pytest.raises(TransferValidationError, match="cannot be merged without a copy") as e:
        plan_transfer(c.request(0, [0, 1]), layers, objs, device_type="cpu")
    assert e.value.field == "paged"


def test_kv_pairs_need_one_k_v_pair_per_layer() -> None:
    c = case(KVFormat.NL_X_TWO_X_NB_BS_NH_HS)
    paged, objs, _ = c.build()
    assert plan_transfer(c.request(1, [0, 1]), paged, objs, device_type="cpu").spec.is_kv_list
    flat = [t for kv in paged for t in kv]
    for bad in (flat, [(*paged[0], paged[0][0]), paged[1]], paged[0][0]):
        with pytest.raises(OperandTypeError, match="NL_X_TWO_X_NB_BS_NH_HS") as e:
            plan_transfer(c.request(1, [0, 1]), bad, objs, device_type="cpu")
        assert e.value.field == "paged"
