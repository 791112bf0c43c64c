"""Formats, directions and shape descriptors (kvactors.core.layouts)."""

from __future__ import annotations

import ast
import pathlib

import msgspec
import pytest

import kvactors
from kvactors.core.layouts import (
    DTYPE_ITEMSIZE,
    FORMAT_SPECS,
    Direction,
    KVFormat,
    PagedKind,
    ShapeDesc,
    format_spec,
)

# LMCache 0.5.6 EngineKVFormat numbers (contract section 2.4).
LMCACHE_NUMBERS = {
    "NB_NL_TWO_BS_NH_HS": 0,
    "NL_X_TWO_NB_BS_NH_HS": 1,
    "NL_X_NB_TWO_BS_NH_HS": 2,
    "NL_X_NB_BS_HS": 3,
    "NL_X_TWO_NB_NH_BS_HS": 6,
    "NL_X_NB_TWO_NH_BS_HS": 7,
    "NB_NL_TWO_NH_BS_HS": 8,
    "TWO_X_NL_X_NB_BS_NH_HS": 9,
    "NL_X_NB_NH_BS_TWO_HS": 10,
    "NL_X_NB_BS_NH_TWO_HS": 11,
    "NL_X_NB_NH_BS_CS": 12,
    "NL_X_NB_BS_NH_CS": 13,
    "NL_X_TWO_X_NB_BS_NH_HS": 16,
    "NL_X_NB_BS_NH_HS": 18,
}


def test_format_numbers_equal_lmcache() -> None:
    assert {f.name: int(f) for f in KVFormat} == LMCACHE_NUMBERS
    assert set(FORMAT_SPECS) == set(KVFormat)


def test_format_numbers_match_installed_lmcache_native() -> None:
    native = pytest.importorskip("lmcache.lmcache_native")
    for f in KVFormat:
        assert int(getattr(native.EngineKVFormat, f.name)) == int(f)
    assert int(native.TransferDirection.H2D) == Direction.H2D == 0  # type: ignore[comparison-overlap]
    assert int(native.TransferDirection.D2H) == Direction.D2H == 1  # type: ignore[comparison-overlap]


@pytest.mark.parametrize("number", [4, 5, 14, 15, 17, 19, 20, -1, 99])
def test_unknown_formats_have_no_spec(number: int) -> None:
    assert format_spec(number) is None


@pytest.mark.parametrize("value", [True, "1", 1.0, None])
def test_non_int_format_has_no_spec(value: object) -> None:
    assert format_spec(value) is None  # type: ignore[arg-type]


def test_directions() -> None:
    assert Direction.H2D == 0  # type: ignore[comparison-overlap]
    assert Direction.D2H == 1  # type: ignore[comparison-overlap]


@pytest.mark.parametrize(
    ("fmt", "tensor", "obj"),
    [
        (KVFormat.NB_NL_TWO_BS_NH_HS, (5, 3, 2, 4, 2, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_TWO_NB_BS_NH_HS, (2, 5, 4, 2, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_NB_TWO_BS_NH_HS, (5, 2, 4, 2, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_NB_BS_HS, (5, 4, 8), (3, 16, 8)),
        (KVFormat.NL_X_TWO_NB_NH_BS_HS, (2, 5, 2, 4, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_NB_TWO_NH_BS_HS, (5, 2, 2, 4, 8), (2, 3, 16, 16)),
        (KVFormat.TWO_X_NL_X_NB_BS_NH_HS, (5, 4, 2, 8), (2, 3, 16, 16)),
        # fused K/V: hs is the packed width, one plane of NH heads
        (KVFormat.NL_X_NB_NH_BS_TWO_HS, (5, 2, 4, 8), (3, 16, 16)),
        (KVFormat.NL_X_NB_BS_NH_TWO_HS, (5, 4, 2, 8), (3, 16, 16)),
        (KVFormat.NL_X_NB_NH_BS_CS, (5, 2, 4, 8), (3, 16, 16)),
        (KVFormat.NL_X_NB_BS_NH_CS, (5, 4, 2, 8), (3, 16, 16)),
        (KVFormat.NB_NL_TWO_NH_BS_HS, (5, 3, 2, 2, 4, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_TWO_X_NB_BS_NH_HS, (5, 4, 2, 8), (2, 3, 16, 16)),
        (KVFormat.NL_X_NB_BS_NH_HS, (5, 4, 2, 8), (3, 16, 16)),
    ],
)
def test_shapes(fmt: KVFormat, tensor: tuple[int, ...], obj: tuple[int, ...]) -> None:
    spec = FORMAT_SPECS[fmt]
    nh = 1 if spec.is_mla else 2
    assert spec.tensor_shape(3, 5, 4, nh, 8) == tensor
    assert spec.object_shape(3, 16, nh, 8) == obj


def test_format_facts() -> None:
    kinds = {f: FORMAT_SPECS[f].kind for f in KVFormat}
    assert kinds[KVFormat.NB_NL_TWO_BS_NH_HS] is PagedKind.CROSS_LAYER
    assert kinds[KVFormat.NB_NL_TWO_NH_BS_HS] is PagedKind.CROSS_LAYER
    assert kinds[KVFormat.TWO_X_NL_X_NB_BS_NH_HS] is PagedKind.KV_LIST
    assert kinds[KVFormat.NL_X_TWO_X_NB_BS_NH_HS] is PagedKind.KV_PAIRS
    assert FORMAT_SPECS[KVFormat.TWO_X_NL_X_NB_BS_NH_HS].is_kv_list
    assert FORMAT_SPECS[KVFormat.NL_X_TWO_X_NB_BS_NH_HS].is_kv_list
    assert [f for f in KVFormat if FORMAT_SPECS[f].is_mla] == [KVFormat.NL_X_NB_BS_HS]
    assert {f for f in KVFormat if FORMAT_SPECS[f].is_hnd} == {
        KVFormat.NL_X_TWO_NB_NH_BS_HS,
        KVFormat.NL_X_NB_TWO_NH_BS_HS,
        KVFormat.NL_X_NB_NH_BS_TWO_HS,
        KVFormat.NL_X_NB_NH_BS_CS,
        KVFormat.NB_NL_TWO_NH_BS_HS,
    }
    # LMCache 0.5.7 sends the block stride of exactly these (gpu_connector/utils.py)
    assert {f for f in KVFormat if FORMAT_SPECS[f].allows_block_padding} == {
        KVFormat.NL_X_NB_BS_HS,
        KVFormat.NL_X_NB_NH_BS_CS,
        KVFormat.NL_X_NB_BS_NH_CS,
        KVFormat.NL_X_NB_BS_NH_HS,
    }
    assert FORMAT_SPECS[KVFormat.NL_X_NB_BS_HS].planes == 1
    assert FORMAT_SPECS[KVFormat.NL_X_TWO_NB_BS_NH_HS].planes == 2
    assert {f for f in KVFormat if FORMAT_SPECS[f].single_plane} == {
        KVFormat.NL_X_NB_NH_BS_TWO_HS,
        KVFormat.NL_X_NB_BS_NH_TWO_HS,
        KVFormat.NL_X_NB_NH_BS_CS,
        KVFormat.NL_X_NB_BS_NH_CS,
        KVFormat.NL_X_NB_BS_NH_HS,
    }
    assert all(FORMAT_SPECS[f].planes == 1 for f in KVFormat if FORMAT_SPECS[f].single_plane)


def test_dtype_table() -> None:
    assert DTYPE_ITEMSIZE["bfloat16"] == DTYPE_ITEMSIZE["float16"] == 2
    assert DTYPE_ITEMSIZE["float8_e4m3fn"] == DTYPE_ITEMSIZE["uint8"] == 1
    assert DTYPE_ITEMSIZE["float32"] == 4


def test_shape_desc_is_wire_safe_and_frozen() -> None:
    sd = ShapeDesc(kv_size=2, nl=32, nb=4096, bs=16, nh=8, hs=128, element_size=2, dtype="bfloat16")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sd), type=ShapeDesc) == sd
    assert sd.block_stride_elems == 0
    with pytest.raises(AttributeError):
        sd.nl = 1  # type: ignore[misc]
    assert ShapeDesc(kv_size=1, nl=1, nb=1, bs=1, nh=1, hs=1, element_size=2).dtype is None


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_pure_modules_import_no_asyncio_or_lmcache() -> None:
    root = pathlib.Path(kvactors.__file__).parent
    assert "torch" not in _imports(root / "core" / "layouts.py")
    files = sorted((root / "core").rglob("*.py")) + sorted((root / "kernels").glob("*.py"))
    assert len(files) > 10
    for f in files:
        bad = _imports(f) & {"asyncio", "lmcache", "lmcache_native", "anyio"}
        assert not bad, f"{f.name} imports {bad}"
