"""The adapter's argument conversion: its per-call shortcuts decide exactly as the full checks."""

from __future__ import annotations

import types

import pytest
import torch

from kvactors.core.layouts import Direction, KVFormat
from kvactors.errors import OperandTypeError, TransferValidationError
from kvactors_lmcache import convert


def _desc(**over: object) -> types.SimpleNamespace:
    facts: dict[str, object] = {"kv_size": 2, "nl": 2, "nb": 8, "bs": 16, "nh": 2, "hs": 64}
    facts.update(element_size=2, block_stride_elems=0, **over)
    return types.SimpleNamespace(**facts)


def test_a_descriptor_changed_in_place_converts_to_its_new_values() -> None:
    sd = _desc(dtype=torch.bfloat16)
    first = convert.shape_desc_of(sd)
    assert (first.nb, first.dtype) == (8, "bfloat16")
    assert convert.shape_desc_of(sd) == first
    sd.nb = 12
    sd.dtype = torch.float16
    again = convert.shape_desc_of(sd)
    assert (again.nb, again.dtype) == (12, "float16")


def test_a_descriptor_without_dtype_or_with_a_bad_one_is_converted_in_full() -> None:
    assert convert.shape_desc_of(_desc()).dtype is None
    with pytest.raises(OperandTypeError, match="dtype"):
        convert.shape_desc_of(_desc(dtype=5))
    with pytest.raises(OperandTypeError, match="PageBufferShapeDesc"):
        convert.shape_desc_of(_desc(nb="many", dtype=None))


@pytest.mark.parametrize("bad", [[1, True], [1, 2.0], [1, "2"]])
def test_block_id_lists_with_anything_but_ints_are_refused(bad: list[object]) -> None:
    with pytest.raises(OperandTypeError, match="block_ids"):
        convert.block_ids_tuple(bad)


def test_block_id_lists_become_tuples() -> None:
    assert convert.block_ids_tuple([3, 1, 2]) == (3, 1, 2)
    assert convert.block_ids_tuple([]) == ()


def test_formats_and_directions_map_by_value() -> None:
    assert convert.format_of(12) is KVFormat(12)
    assert convert.direction_of(1) is Direction.D2H
    with pytest.raises(TransferValidationError, match="engine_kv_format"):
        convert.format_of(14)
    with pytest.raises(TransferValidationError, match="engine_kv_format"):
        convert.format_of(999)
    with pytest.raises(TransferValidationError, match="direction"):
        convert.direction_of(2)
