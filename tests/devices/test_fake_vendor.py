"""The fakes themselves: shape of the modules, real asynchrony, events, IPC, cleanup."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from kvactors.testing import FakeDeviceError, FakeDeviceTensor, fake_vendor


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_install_and_remove_leaves_nothing(kind: str) -> None:
    before = set(threading.enumerate())
    with fake_vendor(kind) as fake:
        mod = getattr(torch, kind)
        assert f"torch_{kind}" in sys.modules
        s = mod.Stream()
        mod.ExternalStream(0)
        fake.inject_error(s)
        assert fake.threads()
    assert not hasattr(torch, kind)
    assert not any(k.startswith(f"torch_{kind}") for k in sys.modules)
    assert all(not t.is_alive() for t in fake.threads())
    assert set(threading.enumerate()) <= before
    assert "pin_memory" not in torch.Tensor.__dict__


def test_module_shapes() -> None:
    with fake_vendor("mlu"):
        import torch_mlu

        assert torch.mlu is torch_mlu.mlu  # type: ignore[attr-defined]
        assert not hasattr(torch_mlu._MLUC, "_construct_MLU_Tensor_From_Storage_And_Metadata")
        assert torch.mlu.default_stream().mlu_stream != 0  # type: ignore[attr-defined]
    with fake_vendor("musa"):
        import torch_musa

        assert torch.musa is torch_musa  # type: ignore[attr-defined]
        assert callable(torch_musa._MUSAC._construct_MUSA_Tensor_From_Storage_And_Metadata)
        assert torch_musa.default_stream().musa_stream == 0
        assert not hasattr(torch_musa.default_stream(), "mlu_stream")
        with pytest.raises(ValueError, match="Expected a musa device"):
            torch_musa.default_stream("cpu")
        torch_musa.device_count.cache_clear()


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_external_stream_zero_is_a_pool_stream(kind: str) -> None:
    with fake_vendor(kind) as fake:
        mod = getattr(torch, kind)
        assert mod.ExternalStream(0) != mod.default_stream()
        s = mod.Stream()
        assert mod.ExternalStream(getattr(s, f"{kind}_stream")) is s
        assert s in fake.streams()


def test_current_stream_is_thread_local() -> None:
    with fake_vendor("musa") as fake:
        mod = torch.musa  # type: ignore[attr-defined]
        s = mod.Stream()
        seen: list[object] = []
        with mod.stream(s):
            t = threading.Thread(target=lambda: seen.append(mod.current_stream()))
            t.start()
            t.join()
            assert mod.current_stream() is s
        assert seen == [mod.default_stream()]
        assert fake.streams()


def test_async_d2h_is_really_async_and_sync_fixes_it() -> None:
    with fake_vendor("mlu", lazy=True) as fake:  # device work runs only once awaited
        dev = fake.to_device(torch.arange(1024.0))
        host = torch.zeros(1024, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        stream = torch.mlu.current_stream()  # type: ignore[attr-defined]
        assert not torch.equal(host, torch.arange(1024.0))
        assert not stream.query()
        stream.synchronize()
        assert torch.equal(host, torch.arange(1024.0))


def test_blocking_and_pageable_copies_complete_on_return() -> None:
    with fake_vendor("musa", lazy=True) as fake:
        dev = fake.to_device(torch.arange(8.0))
        pageable = torch.zeros(8)
        pageable.copy_(dev, non_blocking=True)
        assert torch.equal(pageable, torch.arange(8.0))
        pinned = torch.zeros(8, pin_memory=True)
        pinned.copy_(dev)
        assert torch.equal(pinned, torch.arange(8.0))


def test_kernels_are_enqueued_and_views_alias() -> None:
    with fake_vendor("mlu", lazy=True) as fake:
        dev = fake.to_device(torch.arange(12.0))
        out = dev.view(3, 4)[:, 1:3] * 2
        assert isinstance(out, FakeDeviceTensor)
        assert out.device.type == "mlu"
        assert torch.equal(out.cpu(), torch.tensor([[2.0, 4], [10, 12], [18, 20]]))
        empty = torch.empty(4, device=dev.device)  # type: ignore[call-overload,arg-type]
        assert isinstance(empty, FakeDeviceTensor)


def test_events_order_streams_and_sticky_errors() -> None:
    with fake_vendor("musa", lazy=True) as fake:
        mod = torch.musa  # type: ignore[attr-defined]
        a, b = mod.Stream(), mod.Stream()
        ev = mod.Event()
        assert ev.musa_event == 0
        assert ev.query()
        ev.record(a)
        b.wait_event(ev)
        ev.synchronize()
        assert ev.query()
        fake.inject_error(a, "boom")
        e2 = a.record_event()
        with pytest.raises(FakeDeviceError, match="boom"):
            e2.synchronize()
        with pytest.raises(FakeDeviceError, match="boom"):
            a.synchronize()
        a.synchronize()  # cleared by the sync
        with pytest.raises(FakeDeviceError):
            mod.Event().elapsed_time(mod.Event())


def test_interprocess_events() -> None:
    with fake_vendor("musa") as fake:
        mod = torch.musa  # type: ignore[attr-defined]
        ev = mod.Event(interprocess=True)
        handle = ev.ipc_handle()
        assert isinstance(handle, bytes)
        assert len(handle) == 64
        imported = mod.Event.from_ipc_handle(0, handle)
        ev.record(mod.Stream())
        imported.synchronize()
        with pytest.raises(FakeDeviceError):
            mod.Event.from_ipc_handle(0, b"x" * 63)
        with pytest.raises(ValueError, match="musa"):
            mod.Event.from_ipc_handle("cpu", handle)
        del ev
        with pytest.raises(FakeDeviceError, match="exporter"):
            imported.wait()
        assert fake.ipc_events


def test_musa_ipc_round_trip_and_close() -> None:
    with fake_vendor("musa") as fake:
        ipc = torch.musa.ipc  # type: ignore[attr-defined]
        dev = fake.to_device(torch.arange(16.0).view(4, 4))
        h = ipc.export_tensor(dev[:, 1:3])
        h2 = ipc.MUSAIPCTensorHandle.from_dict(h.to_dict())
        assert h2 == h
        with ipc.open_tensor(h2) as owner:
            assert torch.equal(owner.tensor.cpu(), torch.arange(16.0).view(4, 4)[:, 1:3])
        assert owner.closed
        with pytest.raises(RuntimeError, match="closed"):
            _ = owner.tensor
        with pytest.raises(RuntimeError):
            ipc.export_tensor(torch.zeros(2))


def test_pinning_shims() -> None:
    with fake_vendor("musa") as fake:
        rt = torch.musa.musart()  # type: ignore[attr-defined]
        t = torch.zeros(64)
        assert not t.is_pinned()
        assert rt.musaHostRegister(t.data_ptr(), 256, 0) == rt.musaError.success
        assert t.is_pinned()
        assert rt.musaHostRegister(t.data_ptr(), 256, 0) != 0
        assert rt.musaHostUnregister(t.data_ptr()) == 0
        assert not t.is_pinned()
        assert t.pin_memory().is_pinned()
        assert fake.memory.registered_host_ranges() == []


def test_pointer_storage_only_inside_device_memory() -> None:
    with fake_vendor("mlu") as fake:
        dev = fake.to_device(torch.arange(4.0))
        s = torch._C._construct_storage_from_data_pointer(dev.data_ptr(), dev.device, 16)  # type: ignore[arg-type]
        assert s.nbytes() == 16
        with pytest.raises(FakeDeviceError, match="host pointer"):
            torch._C._construct_storage_from_data_pointer(torch.zeros(4).data_ptr(), dev.device, 16)  # type: ignore[arg-type]
        shared = torch.UntypedStorage._share_mlu_(dev.untyped_storage())  # type: ignore[attr-defined]
        assert len(shared) == 8


def test_unknown_knob_is_rejected() -> None:
    with pytest.raises(TypeError, match="nope"), fake_vendor("mlu", nope=1):
        pass
