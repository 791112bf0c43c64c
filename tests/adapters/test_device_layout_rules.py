"""Device layout rules on the LMCache plugin path (fake vendors, LMCache's own detection).

MLU: LMCache 0.5.6 reads a vLLM-MLU HND cache under the legacy "NHD" answer as format 1 with
``bs``/``nh`` swapped (verified below with LMCache's detector); declared ``legacy``, the
kvactors MLU plugin moves the HND memory correctly, undeclared it refuses. MUSA: formats
LMCache's MUSA MP path refuses are refused before memory is touched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvactors.testing import fake_vendor

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)

NL, NB, NH, BS, HS, BPC = 2, 16, 2, 4, 8, 2
IDS = [3, 9, 0, 12]


def _lmcache_request(layers: list[torch.Tensor], hint: str) -> tuple[Any, Any, Any, int]:
    """What LMCache 0.5.6's engine-driven gather passes for ``layers`` under ``hint``."""
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_num_blocks,
        get_num_layers,
        make_page_buffer_shape_desc,
        normalize_kv_and_discover_format,
    )

    fmt, norm = normalize_kv_and_discover_format(
        layers, EngineType.VLLM, layout_hints={"kv_layout": hint}
    )
    bs = get_block_size(norm, fmt)
    desc = make_page_buffer_shape_desc(
        norm,
        fmt,
        layer_idx=0,
        num_layers_in_group=get_num_layers(norm, fmt),
        num_blocks=get_num_blocks(norm, fmt),
        block_size=bs,
    )
    return fmt, norm, desc, BPC * bs


def _hnd_chunks(cpu: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for c in range(0, len(IDS), BPC):
        ids = IDS[c : c + BPC]
        out.append(
            torch.stack(
                [t[:, ids].permute(0, 1, 3, 2, 4).reshape(2, BPC * BS, NH * HS) for t in cpu], dim=1
            )
        )
    return out


@pytest.mark.parametrize("declared", ["legacy", None])
def test_mlu_plugin_legacy_nhd_answer(
    monkeypatch: pytest.MonkeyPatch, declared: str | None
) -> None:
    import lmcache.lmcache_native as native

    from kvactors.devices.mlu.layouts import LAYOUT_SOURCE_ENV
    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsMluOps

    if declared is None:
        monkeypatch.delenv(LAYOUT_SOURCE_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYOUT_SOURCE_ENV, declared)
    cpu = [torch.randn(2, NB, NH, BS, HS) for _ in range(NL)]  # vLLM-MLU: HND
    with fake_vendor("mlu") as fake, Runtime("mlu") as rt:
        fmt, paged, desc, chunk = _lmcache_request([fake.to_device(t) for t in cpu], "NHD")
        assert int(fmt) == 1
        assert (desc.bs, desc.nh) == (NH, BS)  # LMCache read the HND cache as NHD
        objs = [torch.full((2, NL, chunk, desc.nh * HS), -1.0) for _ in range(2)]
        ops = KvactorsMluOps(runtime_factory=lambda b, i: rt)
        args = (paged, objs, IDS, "mlu:0", native.TransferDirection.D2H, desc, chunk, fmt, 0)
        if declared is None:
            with pytest.raises(ValueError, match="ambiguous"):
                ops.multi_layer_block_kv_transfer(*args)
            assert all(bool((o == -1.0).all()) for o in objs)
            return
        ops.multi_layer_block_kv_transfer(*args)
        fake.synchronize()  # the op returns once enqueued; LMCache syncs before reading chunks
        for got, want in zip(objs, _hnd_chunks(cpu), strict=True):
            assert torch.equal(got.view(want.shape), want)


def test_mlu_plugin_default_layout_source_follows_the_installed_lmcache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no declaration, format 1 is real NHD under LMCache 0.5.7 (it maps vLLM-MLU's legacy
    answer to HND itself) and moves bit-exact; under 0.5.6 it stays ambiguous and is refused."""
    import importlib.util

    import lmcache.lmcache_native as native

    from kvactors.devices.mlu.layouts import LAYOUT_SOURCE_ENV
    from kvactors.runtime import get_runtime
    from kvactors_lmcache.ops import KvactorsMluOps

    monkeypatch.delenv(LAYOUT_SOURCE_ENV, raising=False)
    resolves_legacy = importlib.util.find_spec("lmcache.v1.platform.devices.mlu") is not None
    cpu = [torch.randn(2, NB, BS, NH, HS) for _ in range(NL)]  # real NHD memory
    with fake_vendor("mlu") as fake:
        get_runtime("mlu").close()  # the plugin's own default runtime is made afresh below
        fmt, paged, desc, chunk = _lmcache_request([fake.to_device(t) for t in cpu], "NHD")
        assert int(fmt) == 1
        objs = [torch.full((2, NL, chunk, NH * HS), -1.0) for _ in range(2)]
        ops = KvactorsMluOps()
        args = (paged, objs, IDS, "mlu:0", native.TransferDirection.D2H, desc, chunk, fmt, 0)
        try:
            if not resolves_legacy:
                with pytest.raises(ValueError, match="ambiguous"):
                    ops.multi_layer_block_kv_transfer(*args)
                assert all(bool((o == -1.0).all()) for o in objs)
                return
            ops.multi_layer_block_kv_transfer(*args)
            fake.synchronize()
            for c, got in enumerate(objs):
                ids = IDS[c * BPC : (c + 1) * BPC]
                want = torch.stack([t[:, ids].reshape(2, BPC * BS, NH * HS) for t in cpu], dim=1)
                assert torch.equal(got, want)
        finally:
            get_runtime("mlu").close()  # closes the one the plugin used (made anew if gone)


def test_musa_plugin_refuses_hnd_before_touching_memory() -> None:
    import lmcache.lmcache_native as native

    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsMusaOps

    with fake_vendor("musa") as fake, Runtime("musa") as rt:
        fmt, paged, desc, chunk = _lmcache_request(
            [fake.to_device(torch.randn(2, NB, NH, BS, HS)) for _ in range(NL)], "HND"
        )
        assert int(fmt) == 6
        objs = [torch.full((2, NL, chunk, desc.nh * HS), -1.0) for _ in range(2)]
        ops = KvactorsMusaOps(runtime_factory=lambda b, i: rt)
        with pytest.raises(ValueError, match="MUSA MP block transfer supports only"):
            ops.multi_layer_block_kv_transfer(
                paged, objs, IDS, "musa:0", native.TransferDirection.D2H, desc, chunk, fmt, 0
            )
        assert all(bool((o == -1.0).all()) for o in objs)
