"""The kvactors ops' shape descriptor: LMCache's native class's behaviour, read in one attribute."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
CHUNK = 2 * BS

VALUES: list[Any] = [
    0, 7, -1, True, np.int64(3), torch.tensor(5), 2**31 - 1, -(2**31),
    2**31, -(2**31) - 1, 2**40, 1.0, "3", b"3", None, 1 + 0j, np.float32(2.5),
    np.float64(2.0), np.float32(3e9), np.float32("nan"), np.int64(2**40), np.array(4),
    np.array([5]), torch.tensor(2.7), torch.tensor([3]), Decimal("3.7"), Fraction(7, 2),
]  # fmt: skip


def _native() -> Any:
    import lmcache.lmcache_native as native

    return native


def _ours() -> Any:
    from kvactors_lmcache.shape_desc import KvactorsShapeDesc

    return KvactorsShapeDesc()


def _fill(sd: Any, dtype: Any = torch.bfloat16, nl: int = NL) -> Any:
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 2, nl, NB, BS, NH, HS
    sd.element_size, sd.block_stride_elems = 2, 0
    if dtype is not None:
        sd.dtype = dtype
    return sd


def _store(sd: Any, name: str, value: Any) -> tuple[str, Any]:
    try:
        setattr(sd, name, value)
    except TypeError:
        return ("TypeError", getattr(sd, name))
    got = getattr(sd, name)
    return (type(got).__name__, got)


@pytest.mark.parametrize("name", ["kv_size", "nl", "nb", "bs", "nh", "hs", "element_size",
                                  "block_stride_elems"])  # fmt: skip
def test_fields_accept_and_refuse_what_the_native_class_does(name: str) -> None:
    native, ours = _native().PageBufferShapeDesc(), _ours()
    assert getattr(ours, name) == getattr(native, name) == 0
    for value in VALUES:
        assert _store(ours, name, value) == _store(native, name, value), repr(value)


def test_dtype_is_a_dynamic_attribute_on_both() -> None:
    for sd in (_native().PageBufferShapeDesc(), _ours()):
        assert not hasattr(sd, "dtype")
        assert getattr(sd, "dtype", None) is None
        with pytest.raises(AttributeError):
            del sd.dtype
        sd.dtype = torch.float16
        assert sd.dtype is torch.float16
        sd.dtype = None
        assert hasattr(sd, "dtype")
        assert sd.dtype is None
        del sd.dtype
        assert not hasattr(sd, "dtype")
        sd.anything = 3  # pybind11::dynamic_attr: other attributes are kept too
        assert sd.anything == 3


def test_converts_as_the_native_class_does() -> None:
    from kvactors_lmcache import convert

    for dtype in (torch.bfloat16, torch.float16, "float32", None):
        native, ours = _fill(_native().PageBufferShapeDesc(), dtype), _fill(_ours(), dtype)
        want = convert.shape_desc_of(native)
        assert convert.shape_desc_of(ours) == want
        assert _request(ours).shape == _request(native).shape == want


def _request(sd: Any) -> Any:
    from kvactors_lmcache import convert

    n = _native()
    layers = [torch.zeros((2, NB, BS, NH, HS), dtype=torch.bfloat16) for _ in range(NL)]
    objs = [torch.zeros((2, NL, CHUNK, NH * HS), dtype=torch.bfloat16)]
    req = convert.common_request(
        layers, objs, [0, 1], n.TransferDirection.D2H, sd, CHUNK,
        n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
    )  # fmt: skip
    assert req is not None
    return req


def test_a_write_after_a_call_is_seen_by_the_next() -> None:
    # The converted form is found by the values, never by the descriptor's identity.
    sd = _fill(_ours())
    assert _request(sd).shape.nl == NL
    sd.nl = NL + 1
    assert _request(sd).shape.nl == NL + 1
    sd.dtype = torch.float16
    assert _request(sd).shape.dtype == "float16"
    del sd.dtype
    assert _request(sd).shape.dtype is None


def test_a_dtype_that_is_not_one_is_refused_as_on_the_native_class() -> None:
    from kvactors.errors import OperandTypeError

    for sd in (_fill(_native().PageBufferShapeDesc(), 3), _fill(_ours(), 3)):
        with pytest.raises(OperandTypeError, match=r"not a torch\.dtype"):
            _request(sd)
    for sd in (_fill(_native().PageBufferShapeDesc(), [1]), _fill(_ours(), [1])):
        with pytest.raises(OperandTypeError, match=r"not a torch\.dtype"):
            _request(sd)  # unhashable: never a cache key


def test_lmcache_builds_it_and_both_paths_move_the_same_bytes() -> None:
    # make_page_buffer_shape_desc with the kvactors ops as the process-global ops, then
    # LMCache's torch path and the kvactors op on identical operands with that descriptor.
    from lmcache.v1.gpu_connector import utils as gc_utils
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    from kvactors_lmcache.ops import KvactorsCpuOps

    n = _native()
    fmt = n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    gen = torch.Generator().manual_seed(7)
    layers = [torch.randn((2, NB, BS, NH, HS), generator=gen).to(torch.bfloat16)]
    layers.append(torch.randn((2, NB, BS, NH, HS), generator=gen).to(torch.bfloat16))
    ops = KvactorsCpuOps()
    saved = gc_utils.device_ops
    gc_utils.device_ops = ops
    try:
        sd = gc_utils.make_page_buffer_shape_desc(layers, fmt, 0, NL, NB, BS)
    finally:
        gc_utils.device_ops = saved
    assert type(sd).__name__ == "KvactorsShapeDesc"
    assert convert_values(sd) == convert_values(_fill(_native().PageBufferShapeDesc()))
    ids = [5, 2, 9, 0]
    outs = []
    for op in (multi_layer_block_kv_transfer, ops.multi_layer_block_kv_transfer):
        objs = [torch.full((2, NL, CHUNK, NH * HS), -1.0, dtype=torch.bfloat16) for _ in range(2)]
        op(layers, objs, ids, torch.device("cpu"), n.TransferDirection.D2H, sd, CHUNK, fmt, 0)
        outs.append(objs)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not bool((outs[1][0] == -1).any())


def convert_values(sd: Any) -> tuple[Any, ...]:
    from kvactors_lmcache.shape_desc import FIELDS

    return (*(getattr(sd, f) for f in FIELDS), getattr(sd, "dtype", None))
