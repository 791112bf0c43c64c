"""Caches that share one KV group fail closed, by name (issue 38 item 5).

A sparse-MLA model (DeepSeek V3.2, GLM-5 class) keeps each layer's indexer key cache beside
its MLA cache; vLLM hands LMCache both in one ``kv_caches`` dict. LMCache's engine-driven
callers take the layout from the first cache and count every cache as a layer, so the
kvactors op receives twice as many caches as layers, half of another shape and dtype. The op
refuses the group by name (``TransferValidationError``, ``field="kv_caches"``) before any copy,
on every call, through LMCache's own gather and scatter callers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.errors import TransferValidationError

from .conftest import LMCACHE_MISSING, SKIP_REASON

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

NB, BS, LAYERS, BPC = 8, 4, 2, 2
BLOCKS = [5, 1, 6, 2]
MLA_WIDTH = 576  # kv_lora_rank 512 + rope 64


def _indexer_fp8() -> torch.Tensor:
    return torch.randint(0, 255, (NB, BS, 132), dtype=torch.uint8)  # 128 fp8 + 4 scale bytes


def _indexer_bf16() -> torch.Tensor:
    return torch.randn(NB, BS, 128).to(torch.bfloat16)


def _sparse_mla_caches(indexer: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's kv_caches for a sparse-MLA model: per layer the MLA cache, then the indexer's."""
    kv: dict[str, torch.Tensor] = {}
    for i in range(LAYERS):
        kv[f"model.layers.{i}.self_attn.attn"] = torch.randn(NB, BS, MLA_WIDTH).to(torch.bfloat16)
        kv[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer()
    return kv


@pytest.fixture
def lmcache_calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """LMCache's transfer-context module with the kvactors_cpu ops as its CPU ops."""
    import lmcache.v1.multiprocess.transfer_context.base as tc_base

    from kvactors_lmcache.ops import KvactorsCpuOps

    ops = KvactorsCpuOps()
    monkeypatch.setattr(tc_base, "resolve_device_ops", lambda device_type: ops)
    return tc_base


_FRAGMENT = (
    r"one KV group holds caches of 2 kinds: 2 x \[8, 4, 576\] bfloat16 \(caches 0, 2\); "
    r"2 x \[8, 4, {width}\] {dtype} \(caches 1, 3\)\. Cache count 4 \(shape_desc\.nl 4\) is "
    r"not a layer count"
)


@pytest.mark.parametrize(
    ("indexer", "width", "dtype"),
    [(_indexer_fp8, 132, "uint8"), (_indexer_bf16, 128, "bfloat16")],
    ids=["fp8-indexer", "bf16-indexer"],
)
def test_a_sparse_mla_group_is_refused_by_name_before_any_copy(
    lmcache_calls: Any, indexer: Callable[[], torch.Tensor], width: int, dtype: str
) -> None:
    from lmcache.utils import EngineType

    from kvactors_lmcache.ops import transfer_counts

    tc_base = lmcache_calls
    kv = _sparse_mla_caches(indexer)
    before = {k: v.clone() for k, v in kv.items()}
    hints: Any = {"kv_layout": "NHD"}
    # Where the mismatch comes from: LMCache counts the 4 caches of 2 layers as 4 layers.
    assert tc_base.compute_kv_layout(kv, layout_hints=hints)[1] == 2 * LAYERS
    fragment = _FRAGMENT.format(width=width, dtype=dtype)
    out = [torch.full((2 * LAYERS, BPC * BS, MLA_WIDTH), 7.0).to(torch.bfloat16)]
    counts = transfer_counts()
    for _ in range(2):  # refused again: no request was kept for the one-frame path
        with pytest.raises(TransferValidationError, match=fragment) as info:
            tc_base.gather_paged_kv_to_cpu(
                kv, BLOCKS[:BPC], BPC, layout_hints=hints, engine_type=EngineType.VLLM, out=out
            )
        assert info.value.field == "kv_caches"
        assert "sparse-MLA" in str(info.value)
        with pytest.raises(TransferValidationError, match=fragment):
            tc_base.scatter_cpu_to_paged_kv(
                kv, BLOCKS[:BPC], out, BPC, layout_hints=hints, engine_type=EngineType.VLLM
            )
    assert bool((out[0] == 7.0).all())  # no chunk byte written
    for k, v in kv.items():  # no cache byte written
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
    assert transfer_counts() == counts  # no transfer reached the runtime


def test_a_group_of_one_kind_is_still_served(lmcache_calls: Any) -> None:
    # The same model's MLA caches alone (one kind): gathered and scattered back bit for bit.
    from lmcache.utils import EngineType

    tc_base = lmcache_calls
    kv = {k: v for k, v in _sparse_mla_caches(_indexer_fp8).items() if "indexer" not in k}
    hints: Any = {"kv_layout": "NHD"}
    chunks = tc_base.gather_paged_kv_to_cpu(
        kv, list(BLOCKS), BPC, layout_hints=hints, engine_type=EngineType.VLLM
    )
    assert [tuple(c.shape) for c in chunks] == [(LAYERS, BPC * BS, MLA_WIDTH)] * 2
    restored = {k: torch.zeros_like(v) for k, v in kv.items()}
    tc_base.scatter_cpu_to_paged_kv(
        restored, list(BLOCKS), chunks, BPC, layout_hints=hints, engine_type=EngineType.VLLM
    )
    for k, v in kv.items():
        assert torch.equal(v[BLOCKS], restored[k][BLOCKS])
