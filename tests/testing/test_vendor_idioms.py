"""Inside ``fake_vendor(kind)`` vendor code runs as written: real torch devices and idioms.

One vendor per process: the first fake installed claims torch's private device name
(``KVACTORS_FAKE_VENDOR`` pins which); the other vendor's idiom tests skip here and run in
the fake musa process of ``scripts/test.sh``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvactors.testing import FakeDevice, fake_vendor
from kvactors.testing.pytest_plugin import require_torch_devices

KINDS = ["mlu", "musa"]


@pytest.mark.parametrize("kind", KINDS)
def test_torch_devices_and_tensor_idioms(kind: str) -> None:
    require_torch_devices(kind)
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        dev = torch.device(f"{kind}:0")
        host = torch.arange(24.0).reshape(4, 6)
        a = host.to(f"{kind}:0")
        b = getattr(host, kind)()
        c = torch.empty(4, 6, device=kind)
        z = torch.zeros(3, device=dev)
        for t in (a, b, c, z):
            assert type(t.device) is torch.device
            assert t.device == dev
            assert not t.is_cpu
            assert getattr(t, f"is_{kind}")
        assert not getattr(host, f"is_{kind}")
        assert torch.device(a.device) == dev  # what LMCache's MUSA ops do
        assert a.to(dev) is a
        assert a.to(torch.float16).device == dev
        assert torch.empty_like(a).device == dev
        assert a.new_empty((2,)).device == dev
        c.copy_(a)
        mod.synchronize()
        assert torch.equal(c.cpu(), host)
        ids = torch.tensor([3, 0], device=dev)
        assert torch.equal(torch.index_select(a, 0, ids).cpu(), host[[3, 0]])
        assert torch.equal(a.t().contiguous().cpu(), host.t())
        assert torch.equal(a.as_strided((2, 2), (1, 6)).cpu(), host.as_strided((2, 2), (1, 6)))
        s = mod.Stream()
        assert s.device == dev
        assert fake.streams()


@pytest.mark.parametrize("kind", KINDS)
def test_non_blocking_to_device_runs_on_the_stream_worker(kind: str) -> None:
    """``x.to("mlu:0", non_blocking=True)`` from pinned memory is enqueued, not run inline."""
    require_torch_devices(kind)
    with fake_vendor(kind) as fake:
        mod = getattr(torch, kind)
        s = mod.Stream()
        gate = threading.Event()
        s.enqueue(gate.wait)  # hold the stream: what is queued behind it has not run yet
        src = (torch.arange(8.0) + 1000.0).pin_memory()
        with mod.stream(s):
            dst = src.to(f"{kind}:0", non_blocking=True)
        assert dst.device == torch.device(kind, 0)
        assert not torch.equal(fake.peek(dst), src)  # returned before the copy ran
        gate.set()
        s.synchronize()
        assert torch.equal(fake.peek(dst), src)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_d2h_bug_knob_keeps_working_with_torch_devices(kind: str) -> None:
    require_torch_devices(kind)
    with fake_vendor(kind, strided_d2h_bug=True, lazy=True) as fake:
        dev = fake.to_device(torch.arange(16.0).reshape(4, 4))
        host = torch.zeros(4, 8, pin_memory=True)[:, :4]  # strided host slice
        host.copy_(dev, non_blocking=True)
        getattr(torch, kind).synchronize()
        assert not torch.equal(host, torch.arange(16.0).reshape(4, 4))  # stale: the bug
        host.copy_(dev)  # blocking: correct
        assert torch.equal(host, torch.arange(16.0).reshape(4, 4))


def test_second_vendor_in_a_process_falls_back_to_fake_devices() -> None:
    """Only one kind can own torch's device name; the other gets FakeDevice objects."""
    with fake_vendor("mlu") as mlu, fake_vendor("musa") as musa:
        owners = [f for f in (mlu, musa) if f.torch_devices]
        assert len(owners) == 1
        other = musa if owners[0] is mlu else mlu
        t = other.to_device(torch.ones(2))
        assert isinstance(t.device, FakeDevice)
        assert str(t.device) == f"{other.kind}:0"
        assert torch.equal(t.cpu(), torch.ones(2))
        assert type(owners[0].to_device(torch.ones(2)).device) is torch.device
