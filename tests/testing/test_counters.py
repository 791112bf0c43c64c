"""The fake vendor's device-operation counters count what a card would do, and only that."""

from __future__ import annotations

import pytest
import torch

from kvactors.testing import OpCounts, fake_vendor


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_each_operation_kind_is_counted(kind: str) -> None:
    with fake_vendor(kind) as fake:
        mod = getattr(torch, kind)
        dev = fake.to_device(torch.arange(32.0).reshape(8, 4))
        pinned = torch.zeros(8, 4).pin_memory()
        pageable = torch.zeros(8, 4)
        ids = fake.to_device(torch.tensor([1, 5]))

        with fake.counting() as ops:
            pinned.copy_(dev, non_blocking=True)
        assert ops.counts == OpCounts(d2h=1)
        with fake.counting() as ops:
            pageable.copy_(dev, non_blocking=True)  # pageable: the host waits
        assert ops.counts == OpCounts(d2h=1, syncs=1)
        with fake.counting() as ops:
            out = torch.index_select(dev, 0, ids)
        assert ops.counts == OpCounts(launches=1, allocations=1, alloc_bytes=out.nbytes)
        with fake.counting() as ops:
            dev[:2].copy_(dev[2:4])
        assert ops.counts == OpCounts(launches=1, d2d=1)
        with fake.counting() as ops:
            torch.index_select(dev, 0, torch.tensor([1, 5]), out=out)  # host index: an upload
        assert ops.counts == OpCounts(launches=1, h2d=1, syncs=1)
        with fake.counting() as ops:
            torch.empty(4, device=f"{kind}:0")
            dev.new_empty((3,))
        assert (ops.counts.allocations, ops.counts.launches) == (2, 0)
        with fake.counting() as ops:
            mod.synchronize()
            mod.current_stream().synchronize()
            dev.sum().item()  # a host read
        assert ops.counts.syncs == 3
        assert ops.counts.launches == 1
        snap = fake.counters()
        assert snap.copies == snap.h2d + snap.d2h + snap.d2d > 0


def test_declared_memory_is_not_an_allocation() -> None:
    with fake_vendor("mlu") as fake, fake.counting() as ops:
        fake.adopt(torch.zeros(16))
    assert ops.counts == OpCounts()
