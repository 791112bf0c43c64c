"""MUSA backend specifics: pointer views, IPC, capabilities, fallback, cache context."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvactors.devices.base import IPCHandle
from kvactors.devices.musa import MusaBackend
from kvactors.devices.musa_context import MusaCacheContext
from kvactors.devices.musa_contract import (
    check_format,
    check_pointer_tensor,
    exact_dtype,
    group_pointers,
    paged_view_geometry,
)
from kvactors.errors import (
    DeviceOpError,
    InvalidPointerError,
    IPCError,
    OperandTypeError,
    TransferValidationError,
    UnsupportedOperationError,
)
from kvactors.layouts import ShapeDesc
from kvactors.testing import FakeDeviceTensor, FakeVendor, fake_vendor


@pytest.mark.parametrize("ctor", [True, False])
def test_tensor_from_ptr_both_routes(ctor: bool) -> None:
    with fake_vendor("musa", vendor_constructor=ctor) as fake:
        b = MusaBackend()
        dev = fake.to_device(torch.arange(24.0))
        v = b.tensor_from_ptr(dev.data_ptr(), (2, 3), torch.float32, stride=(4, 1),
                              storage_offset=1)
        assert isinstance(v, FakeDeviceTensor)
        assert torch.equal(v.cpu(), torch.tensor([[1.0, 2, 3], [5, 6, 7]]))
        v.fill_(-1.0)
        b.synchronize(b.stream_from_handle(0, 0))
        assert fake.peek(dev)[1] == -1.0
        with pytest.raises(DeviceOpError, match="host pointer"):
            b.tensor_from_ptr(torch.zeros(8).data_ptr(), (2,), torch.float32)
        with pytest.raises(InvalidPointerError):
            b.tensor_from_ptr(0, (2,), torch.float32)
        with pytest.raises(InvalidPointerError):
            b.tensor_from_ptr(dev.data_ptr(), (2, 3), torch.float32, stride=(1,))


def test_handle0_and_stream_handles(fake_musa: FakeVendor) -> None:
    b = MusaBackend()
    assert b.stream_handle(b.stream_from_handle(0, 0)) == 0
    assert b.stream_from_handle(0, 0) is torch.musa.default_stream(0)  # type: ignore[attr-defined]


def test_ipc_wire_round_trip(fake_musa: FakeVendor) -> None:
    b = MusaBackend()
    dev = fake_musa.to_device(torch.arange(16.0).view(4, 4))
    h = b.ipc_export(dev[1:])
    wire = msgspec.msgpack.encode(h)
    assert str(dev.data_ptr()) not in wire.decode("latin-1")
    h2 = msgspec.msgpack.decode(wire, type=IPCHandle)
    owner = b.ipc_open(h2)
    assert torch.equal(owner.tensor.cpu(), torch.arange(4.0, 16.0).view(3, 4))
    owner.close()
    owner.close()
    assert owner.closed
    with pytest.raises(IPCError):
        _ = owner.tensor
    bad = msgspec.structs.replace(h2, shape=(2, 4))
    with pytest.raises(IPCError, match="disagrees"):
        b.ipc_open(bad)
    with pytest.raises(TransferValidationError):
        b.ipc_export(torch.zeros(2))


def test_capabilities_gate_handle_mode() -> None:
    env = {"LMCACHE_MUSA_HANDLE_TRANSFER": "1"}
    with fake_vendor("musa"):
        assert MusaBackend(env=env).capabilities().handle_mode
        assert MusaBackend(env=env).transfer_mode("auto") == "engine_driven"
        assert MusaBackend(env=env).transfer_mode("lmcache_driven") == "lmcache_driven"
        with pytest.raises(UnsupportedOperationError, match="opt-in"):
            MusaBackend(env={}).transfer_mode("lmcache_driven")
    with fake_vendor("musa", ipc=False):
        caps = MusaBackend(env=env).capabilities()
        assert not caps.memory_ipc
        assert not caps.handle_mode
        with pytest.raises(UnsupportedOperationError, match="ipc"):
            MusaBackend().ipc_export(torch.zeros(1))
    with fake_vendor("musa", event_ipc=False):
        caps = MusaBackend(env=env).capabilities()
        assert caps.memory_ipc
        assert not caps.event_ipc
        assert not caps.handle_mode


def test_contract_layouts_dtypes_pointers() -> None:
    for fmt in (1, 3, 9):
        check_format(fmt)
    for fmt in (0, 2, 6, 7, 5, 14, True):
        with pytest.raises(TransferValidationError, match="supports only"):
            check_format(fmt)
    with pytest.raises(TransferValidationError, match=r"exact shape_desc\.dtype"):
        exact_dtype(2, None)
    assert exact_dtype(2, "bfloat16") is torch.bfloat16
    assert exact_dtype(4, None) is torch.float32
    with pytest.raises(TransferValidationError):
        exact_dtype(2, "float32")
    shape = ShapeDesc(kv_size=1, nl=2, nb=6, bs=4, nh=1, hs=8, element_size=2,
                      block_stride_elems=40)
    assert paged_view_geometry(3, shape) == ((6, 4, 8), (40, 8, 1))
    assert group_pointers([101, 102, 201, 202], 9, 2) == [[101, 102], [201, 202]]
    assert check_pointer_tensor(torch.tensor([1, 2, 3, 4]), 9, 2) == (1, 2, 3, 4)
    with pytest.raises(TransferValidationError):
        check_pointer_tensor(torch.tensor([1, 2, 3]), 9, 2)
    with pytest.raises(OperandTypeError):
        check_pointer_tensor(torch.tensor([1.0, 2.0]), 1, 2)


class _Recorder:
    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail, self.closed = log, name, fail, False

    @property
    def tensor(self) -> torch.Tensor:
        raise AssertionError

    def close(self) -> None:
        self.log.append(self.name)
        self.closed = True
        if self.fail:
            raise IPCError("close failed")


def test_cache_context_close_order(fake_musa: FakeVendor) -> None:
    log: list[str] = []

    class SpyBackend(MusaBackend):
        def synchronize(self, stream: object) -> None:  # type: ignore[override]
            log.append("sync")
            raise DeviceOpError("sync failed", device="musa:0", op="synchronize")

    b = SpyBackend()
    k = [fake_musa.to_device(torch.zeros(4)) for _ in range(2)]
    v = [fake_musa.to_device(torch.zeros(4)) for _ in range(2)]
    ctx = MusaCacheContext(b, b.new_stream(0), 0, [k, v], staging_nbytes=64,
                           owners=[_Recorder(log, "first", fail=True), _Recorder(log, "second")])
    ptrs = ctx.pointer_tables[1]
    b.module.synchronize()
    assert fake_musa.peek(ptrs).tolist() == [t.data_ptr() for t in v]
    assert ctx.staging_view(torch.float16, (4, 2)).shape == (4, 2)
    with pytest.raises(TransferValidationError):
        ctx.staging_view(torch.float32, (32,))
    with pytest.raises(DeviceOpError):
        ctx.close()
    assert log == ["sync", "first", "second"]
    assert ctx.pointer_tables == []
    assert ctx.groups == []
    ctx.close()
    assert log == ["sync", "first", "second"]


def test_native_fallback(fake_musa: FakeVendor) -> None:
    from kvactors.plans import plan_transfer
    from tests._transfer_cases import Case

    case = Case(fmt=1, nl=1, nb=4, bs=4, nh=1, hs=4, dtype=torch.float32,  # type: ignore[arg-type]
                alloc="stacked", seed=0, n_objects=1)
    paged, objs, _ = case.build()
    plan = plan_transfer(case.request(1, [0, 1]), paged, objs, device_type="cpu")
    calls: list[str] = []

    class Native:
        def __init__(self, accept: bool) -> None:
            self.accept = accept

        def transfer(self, plan: object, paged: object, objects: object) -> bool:
            calls.append("native")
            return self.accept

    on = {"LMCACHE_MUSA_NATIVE_KV_TRANSFER": "1"}
    assert MusaBackend(native=Native(True), env=on).run_transfer(
        plan, paged, objs, lambda: calls.append("torch")) == "native"
    assert MusaBackend(native=Native(False), env=on).run_transfer(
        plan, paged, objs, lambda: calls.append("torch")) == "torch"
    assert MusaBackend(native=Native(True), env={}).run_transfer(
        plan, paged, objs, lambda: calls.append("torch")) == "torch"
    assert calls == ["native", "native", "torch", "torch"]
