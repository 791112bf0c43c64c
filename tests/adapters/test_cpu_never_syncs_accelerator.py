"""A CPU transfer never synchronizes an accelerator (LMCache#5157's bug, kept out).

With a fake MLU or MUSA installed and busy (lazy: its queued work runs only once something
waits for the device), a store and a retrieve of CPU KV, through ``Runtime.transfer`` on the
``cpu`` backend and through the ``kvactors_cpu`` ops driven by LMCache's own gather and
scatter callers, count 0 device syncs and leave the accelerator's queued work unrun. Then the
test synchronizes the accelerator itself, which runs that work and counts one sync: the
counters and the marker would have seen a sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvactors.testing import FakeVendor

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
BPC = 2  # blocks per chunk
BLOCKS = [3, 0, 9, 12]


def _kv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn((2, NB, BS, NH, HS), generator=gen).to(
            torch.bfloat16
        )
        for i in range(NL)
    }


@pytest.fixture(params=["mlu", "musa"])
def busy(request: pytest.FixtureRequest) -> Iterator[tuple[FakeVendor, list[str]]]:
    """A fake vendor with work queued on its current stream that has not run (``lazy``)."""
    from kvactors.testing import fake_vendor

    with fake_vendor(request.param, lazy=True) as fake:
        ran: list[str] = []
        fake.current_stream().enqueue(lambda: ran.append("accelerator work"))
        yield fake, ran


def _assert_no_sync(fake: FakeVendor, ran: list[str], transfers: Callable[[], None]) -> None:
    with fake.counting() as ops:
        transfers()
    assert ops.counts.syncs == 0, ops.counts
    assert ops.counts.copies == 0, ops.counts
    assert ran == []  # nobody waited for the accelerator
    with fake.counting() as control:
        fake.synchronize()
    assert control.counts.syncs == 1
    assert ran == ["accelerator work"]


def test_runtime_transfer_on_cpu_never_syncs_a_busy_accelerator(
    busy: tuple[FakeVendor, list[str]],
) -> None:
    from kvactors.core.layouts import KVFormat, ShapeDesc
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

    fake, ran = busy
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    paged = list(_kv().values())
    chunks = [torch.zeros((2, NL, BPC * BS, NH * HS), dtype=torch.bfloat16) for _ in range(2)]

    def request(direction: int) -> TransferRequest:
        return TransferRequest(
            fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
            direction=direction,
            block_ids=tuple(BLOCKS),
            chunk_size=BPC * BS,
            shape=shape,
        )

    restored = [torch.zeros_like(t) for t in paged]

    def transfers() -> None:
        with Runtime("cpu") as rt:
            rt.transfer(request(1), paged, chunks)  # store (D2H)
            rt.transfer(request(0), restored, chunks)  # retrieve (H2D)
            rt.synchronize()

    _assert_no_sync(fake, ran, transfers)
    for src, dst in zip(paged, restored, strict=True):
        assert torch.equal(src[:, BLOCKS], dst[:, BLOCKS])


@pytest.mark.lmcache
@pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)
def test_kvactors_cpu_store_and_retrieve_never_sync_a_busy_accelerator(
    busy: tuple[FakeVendor, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmcache.v1.multiprocess.transfer_context.base as tc_base
    from lmcache.utils import EngineType

    from kvactors_lmcache.ops import KvactorsCpuOps, transfer_counts

    fake, ran = busy
    ops = KvactorsCpuOps()
    # What LMCache resolves for CPU KV when kvactors_cpu is selected (KVACTORS_LMCACHE_CPU=1).
    monkeypatch.setattr(tc_base, "resolve_device_ops", lambda device_type: ops)
    kv = _kv()
    restored = {k: torch.zeros_like(v) for k, v in kv.items()}
    hints: Any = {"kv_layout": "NHD"}
    chunks: list[torch.Tensor] = []
    before = transfer_counts()

    def transfers() -> None:
        chunks.extend(
            tc_base.gather_paged_kv_to_cpu(
                kv, list(BLOCKS), BPC, layout_hints=hints, engine_type=EngineType.VLLM
            )
        )
        tc_base.scatter_cpu_to_paged_kv(
            restored, list(BLOCKS), chunks, BPC, layout_hints=hints, engine_type=EngineType.VLLM
        )

    _assert_no_sync(fake, ran, transfers)
    after = transfer_counts()
    assert after.get("cpu:D2H", 0) - before.get("cpu:D2H", 0) == 1  # the plugin served both
    assert after.get("cpu:H2D", 0) - before.get("cpu:H2D", 0) == 1
    for k in kv:
        assert torch.equal(kv[k][:, BLOCKS], restored[k][:, BLOCKS])
