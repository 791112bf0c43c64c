"""What LMCache 0.5.7 changed on the plugin's path, each against LMCache's own ops (both versions).

Every case runs the kvactors CPU ops and LMCache's own op for the same format on identical
operands (LMCache's generic torch op, or for the RBLN singleton-axis formats LMCache's RBLN ops,
which are pure torch) and compares bytes; or it checks a refusal that leaves every operand
untouched. A case that needs an enum member its LMCache version predates (``PREDATES``) is not
collected for that version; the 0.5.7rc2 lane runs it (scripts/test.sh).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

NL, NB, BS, NH, HS = 2, 12, 4, 2, 8
CPU = torch.device("cpu")

#: The ``EngineKVFormat`` members used here that an LMCache version predates: the cases that
#: need them are not collected there. A member missing on any other version fails its case.
PREDATES: dict[str, frozenset[str]] = {"0.5.6": frozenset({"NL_X_NB_TWO_NH_ONE_BS_HS"})}
_MISSING_HERE = PREDATES.get(
    "" if LMCACHE_MISSING else importlib.metadata.version("lmcache"), frozenset()
)


def _native() -> Any:
    import lmcache.lmcache_native as native

    return native


def _fmt(name: str) -> Any:
    fmt = getattr(_native().EngineKVFormat, name, None)
    assert fmt is not None, f"EngineKVFormat.{name} is missing from this LMCache"
    return fmt


def _ops() -> Any:
    from kvactors_lmcache.ops import KvactorsCpuOps

    return KvactorsCpuOps()


def _desc(kv: Any, fmt: Any, block_stride_elems: int | None = None) -> Any:
    from lmcache.v1.gpu_connector.utils import make_page_buffer_shape_desc

    return make_page_buffer_shape_desc(kv, fmt, 0, NL, NB, BS, block_stride_elems)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8).clone() for t in ts]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _zeros_like_strided(t: torch.Tensor) -> torch.Tensor:
    """Zeros with ``t``'s shape *and strides* (a padded pool stays padded)."""
    base = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _round(oracle: Any, kv: list[torch.Tensor], fmt: Any, sd: Any, obj_shape: tuple[int, ...],
           chunk: int, ids: list[int], skip: int) -> None:  # fmt: skip
    """D2H then H2D through kvactors and ``oracle`` on identical operands; bytes must agree."""
    n = _native()
    n_obj = -(-len(ids) * BS // chunk) + 1  # one object more than the blocks cover
    dtype = kv[0].dtype
    got = [torch.full(obj_shape, -7.0, dtype=dtype) for _ in range(n_obj)]
    ref = [o.clone() for o in got]
    _ops().multi_layer_block_kv_transfer(kv, got, list(ids), CPU, n.TransferDirection.D2H, sd,
                                         chunk, fmt, 0)  # fmt: skip
    oracle(kv, ref, list(ids), CPU, n.TransferDirection.D2H, sd, chunk, fmt, 0)
    assert _same(got, ref), "D2H differs from LMCache's op"
    assert not _same(got, [torch.full(obj_shape, -7.0, dtype=dtype)] * n_obj)
    dst = [_zeros_like_strided(t) for t in kv]
    dst_ref = [_zeros_like_strided(t) for t in kv]
    _ops().multi_layer_block_kv_transfer(dst, ref, list(ids), CPU, n.TransferDirection.H2D, sd,
                                         chunk, fmt, skip)  # fmt: skip
    oracle(dst_ref, ref, list(ids), CPU, n.TransferDirection.H2D, sd, chunk, fmt, skip)
    assert _same(dst, dst_ref), "H2D differs from LMCache's op"
    assert any(bool(t.any()) for t in dst)


# -- the new RBLN format NL_X_NB_TWO_NH_ONE_BS_HS (0.5.7) and its two-major sibling -----------


#: format -> (its pool's shape, the format of the same memory seen without the size-1 axis),
#: for the formats this LMCache version has.
_SINGLETON_AXIS = {
    name: case
    for name, case in {
        "NL_X_NB_TWO_NH_ONE_BS_HS": ((NB, 2, NH, 1, BS, HS), "NL_X_NB_TWO_NH_BS_HS"),
        "NL_X_TWO_NB_NH_ONE_BS_HS": ((2, NB, NH, 1, BS, HS), "NL_X_TWO_NB_NH_BS_HS"),
    }.items()
    if name not in _MISSING_HERE
}


@pytest.mark.parametrize("name", sorted(_SINGLETON_AXIS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_singleton_axis_formats_bit_exact(name: str, dtype: torch.dtype) -> None:
    from lmcache.v1.platform.devices.rbln.device_ops import RblnDeviceOps
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as torch_op

    shape, squeezed = _SINGLETON_AXIS[name]
    fmt = _fmt(name)
    kv = [_rand(shape, dtype, 10 + i) for i in range(NL)]
    sd = _desc(kv, fmt)
    ids, chunk = [9, 1, 4, 0, 11], 2 * BS  # out of order, partial last object
    obj = (2, NL, chunk, NH * HS)
    # LMCache's own op for these formats (RBLN, pure torch) on identical operands.
    _round(RblnDeviceOps().multi_layer_block_kv_transfer, kv, fmt, sd, obj, chunk, ids, skip=1)
    # LMCache's generic torch op on the same bytes seen without the size-1 axis.
    n = _native()
    got = [torch.zeros(obj, dtype=dtype) for _ in range(3)]
    ref = [o.clone() for o in got]
    _ops().multi_layer_block_kv_transfer(kv, got, ids, CPU, n.TransferDirection.D2H, sd, chunk,
                                         fmt, 0)  # fmt: skip
    flat = [t.squeeze(3) for t in kv]
    torch_op(flat, ref, ids, CPU, n.TransferDirection.D2H, _desc(flat, _fmt(squeezed)), chunk,
             _fmt(squeezed), 0)  # fmt: skip
    assert _same(got, ref)


@pytest.mark.parametrize("name", sorted(_SINGLETON_AXIS))
def test_singleton_axis_format_without_the_axis_is_refused_untouched(name: str) -> None:
    shape, _ = _SINGLETON_AXIS[name]
    fmt = _fmt(name)
    n = _native()
    good = [_rand(shape, torch.bfloat16, 3) for _ in range(NL)]
    sd = _desc(good, fmt)
    bad = [t.squeeze(3).clone() for t in good]  # rank 5: not this format
    objs = [torch.full((2, NL, 2 * BS, NH * HS), -7.0, dtype=torch.bfloat16) for _ in range(2)]
    before = _bits(objs) + _bits(bad)
    for direction in (n.TransferDirection.D2H, n.TransferDirection.H2D):
        with pytest.raises(ValueError, match="size-1 axis 3"):
            _ops().multi_layer_block_kv_transfer(bad, objs, [0, 1, 2, 3], CPU, direction, sd,
                                                 2 * BS, fmt, 0)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, _bits(objs) + _bits(bad), strict=True))


# -- blocked-scale formats (fp8 values + fp32 scales): refused before memory is touched --------


def _blocked_scale_formats() -> list[Any]:
    if LMCACHE_MISSING:
        return []
    import lmcache.lmcache_native as native
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class

    found = []
    for fmt in native.EngineKVFormat.__members__.values():
        try:
            spec = get_spec_class(fmt)
        except Exception:
            continue
        if getattr(spec, "requires_blocked_scale_repacking", False):
            found.append(fmt)
    return found or [native.EngineKVFormat.NL_X_NB_BSV_BSS]  # 0.5.6: no trait, same format


@pytest.mark.parametrize("fmt", _blocked_scale_formats(), ids=lambda f: str(getattr(f, "name", f)))
def test_blocked_scale_formats_refused_before_memory_is_touched(fmt: Any) -> None:
    n = _native()
    row = 132  # 128 fp8 value bytes + one fp32 scale per token
    pages = [torch.randint(0, 255, (NB, BS, row), dtype=torch.uint8) for _ in range(NL)]
    sd = _desc(pages, fmt)
    objs = [torch.full((NL, 2 * BS, row), 7, dtype=torch.uint8) for _ in range(2)]
    before = _bits(objs) + _bits(pages)
    for direction in (n.TransferDirection.D2H, n.TransferDirection.H2D):
        with pytest.raises(ValueError, match="blocked-scale"):
            _ops().multi_layer_block_kv_transfer(pages, objs, [0, 1, 2, 3], CPU, direction, sd,
                                                 2 * BS, fmt, 0)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, _bits(objs) + _bits(pages), strict=True))


# -- padded MLA pools: block_stride_elems is set on the engine-driven path in 0.5.7 -----------


def _padded_mla(dtype: torch.dtype, pad: int, seed: int) -> list[torch.Tensor]:
    pool = [_rand((NB, BS * HS + pad), dtype, seed + i) for i in range(NL)]
    return [p.as_strided((NB, BS, HS), (BS * HS + pad, HS, 1)) for p in pool]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_mla_with_block_stride_elems_bit_exact(dtype: torch.dtype) -> None:
    from lmcache.v1.gpu_connector.utils import resolve_block_stride_and_log_layout
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as torch_op

    fmt = _native().EngineKVFormat.NL_X_NB_BS_HS
    kv = _padded_mla(dtype, pad=24, seed=20)
    stride = resolve_block_stride_and_log_layout(kv, fmt, layer_idx=0, group_idx=0)
    assert stride == BS * HS + 24  # LMCache reports the padded stride
    sd = _desc(kv, fmt, stride)
    assert sd.block_stride_elems == BS * HS + 24
    chunk = 2 * BS
    _round(torch_op, kv, fmt, sd, (NL, chunk, HS), chunk, [3, 7, 0, 10, 5], skip=2)


def test_padded_mla_with_a_wrong_block_stride_is_refused_untouched() -> None:
    fmt = _native().EngineKVFormat.NL_X_NB_BS_HS
    n = _native()
    kv = _padded_mla(torch.bfloat16, pad=24, seed=30)
    sd = _desc(kv, fmt, BS * HS + 8)  # says 8 elements of padding; the pool has 24
    objs = [torch.full((NL, 2 * BS, HS), -7.0, dtype=torch.bfloat16) for _ in range(2)]
    before = _bits(objs) + _bits([k.contiguous() for k in kv])
    for direction in (n.TransferDirection.D2H, n.TransferDirection.H2D):
        with pytest.raises(ValueError, match="block stride"):
            _ops().multi_layer_block_kv_transfer(kv, objs, [0, 1, 2, 3], CPU, direction, sd,
                                                 2 * BS, fmt, 0)  # fmt: skip
    after = _bits(objs) + _bits([k.contiguous() for k in kv])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


# -- window-sized lmcache_chunk_size with window-relative skips (sliding-window groups) --------


@pytest.mark.parametrize(("window_blocks", "skip"), [(1, 0), (1, 2), (3, 1), (3, 4)])
def test_window_sized_chunks_with_window_relative_skips_bit_exact(
    window_blocks: int, skip: int
) -> None:
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as torch_op

    fmt = _native().EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    kv = [_rand((2, NB, BS, NH, HS), torch.bfloat16, 40 + i) for i in range(NL)]
    sd = _desc(kv, fmt)
    window = window_blocks * BS  # lmcache_chunk_size is the window, not the server chunk
    ids = [2, 8, 5, 11, 0, 6, 3][: 2 * window_blocks + 1]
    _round(torch_op, kv, fmt, sd, (2, NL, window, NH * HS), window, ids, skip=skip)
