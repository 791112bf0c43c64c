"""vLLM-MLU layout normalisation (pure)."""

from __future__ import annotations

import pytest
import torch

from kvactors.devices.mlu_layouts import (
    classify_layer,
    normalize_layout_hint,
    squeeze_mla,
    unwrap_layer,
)
from kvactors.errors import OperandTypeError, TransferValidationError
from kvactors.layouts import KVFormat


@pytest.mark.parametrize("hint", [None, "NHD", "HND"])
def test_legacy_answers_are_hnd(hint: str | None) -> None:
    assert normalize_layout_hint(hint) == "HND"


@pytest.mark.parametrize(("hint", "want"), [("NHD", "NHD"), ("LBNHC", "NHD"), ("LBHNC", "HND")])
def test_resolved_answers_are_kept(hint: str, want: str) -> None:
    assert normalize_layout_hint(hint, "resolved") == want
    with pytest.raises(TransferValidationError):
        normalize_layout_hint("BLHNC", "resolved")


def test_mha_shape_is_hnd_by_default_even_when_nb_equals_nh() -> None:
    t = torch.zeros(2, 4, 4, 16, 8)  # NB == NH: shape alone is ambiguous
    _, lay = classify_layer(t, "NHD")
    assert (lay.fmt, lay.num_heads, lay.block_size) == (KVFormat.NL_X_TWO_NB_NH_BS_HS, 4, 16)
    _, lay = classify_layer(torch.zeros(2, 4, 16, 2, 8), "NHD", "resolved")
    assert (lay.fmt, lay.block_size, lay.num_heads) == (KVFormat.NL_X_TWO_NB_BS_NH_HS, 16, 2)


def test_mla_squeezed_keeps_padding() -> None:
    base = torch.zeros(1, 6, 1, 4, 10)[..., :8]  # padded block stride 40
    v, lay = classify_layer(base)
    assert v.shape == (6, 4, 8)
    assert v.stride() == (40, 10, 1)
    assert lay.fmt is KVFormat.NL_X_NB_BS_HS
    with pytest.raises(TransferValidationError):
        squeeze_mla(torch.zeros(2, 6, 1, 4, 8))
    with pytest.raises(TransferValidationError):
        classify_layer(torch.zeros(3, 3))


def test_unwrap_lists_and_scales() -> None:
    cache = torch.zeros(2, 4, 2, 16, 8, dtype=torch.bfloat16)
    layer = unwrap_layer([cache, torch.empty(0), torch.empty(0)])
    assert layer.cache is cache
    assert layer.scale is None
    q = torch.zeros(2, 4, 2, 16, 8, dtype=torch.int8)
    scale = torch.ones(2, 4, 2, 16)
    with pytest.raises(TransferValidationError, match="scales"):
        unwrap_layer([q, scale, torch.empty(0)])
    moved = unwrap_layer([q, scale, torch.empty(0)], move_scales=True)
    assert moved.scale is scale
    assert unwrap_layer(cache).cache is cache
    with pytest.raises(OperandTypeError):
        unwrap_layer("nope")
