"""The kvactors MLU plugin refuses LMCache's legacy in-process connector ops, as LMCache's own
MLU ops do, instead of running LMCache's torch baseline on MLU memory."""

from __future__ import annotations

import pytest
import torch

from kvactors.errors import UnsupportedOperationError
from kvactors.testing import fake_vendor

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)

LEGACY = (
    "multi_layer_kv_transfer",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)


@pytest.mark.parametrize("op", LEGACY)
def test_mlu_legacy_connector_ops_refuse_before_touching_memory(op: str) -> None:
    import lmcache.lmcache_native as native

    from kvactors_lmcache.ops import KvactorsMluOps

    with fake_vendor("mlu") as fake:
        dev = [fake.to_device(torch.full((2, 16, 16), 5.0)) for _ in range(2)]
        kv = torch.full((2, 2, 8, 16), 7.0)
        ops = KvactorsMluOps(runtime_factory=lambda b, i: pytest.fail("no runtime needed"))
        # The argument shapes LMCache's torch baseline takes for multi_layer_kv_transfer.
        args = (
            kv,
            dev,
            torch.arange(8),
            dev[0].device,
            16,
            native.TransferDirection.D2H,
            native.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            4,
            8,
        )
        with pytest.raises(NotImplementedError, match="MLU requires the MP engine_driven") as info:
            getattr(ops, op)(*args)
        assert isinstance(info.value, UnsupportedOperationError)
        assert bool((kv == 7.0).all())
        assert all(bool((fake.peek(t) == 5.0).all()) for t in dev)


def test_the_torch_baseline_still_serves_other_devices() -> None:
    """Only the MLU class refuses: the CPU/MUSA plugins keep LMCache's inherited ops."""
    from lmcache.v1.platform.base.device_ops import DeviceOps

    from kvactors_lmcache.ops import KvactorsCpuOps, KvactorsMusaOps

    for op in LEGACY:
        for cls in (KvactorsCpuOps, KvactorsMusaOps):
            assert getattr(cls, op) is getattr(DeviceOps, op)
