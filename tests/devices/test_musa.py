"""MUSA backend specifics: pointer views, IPC, capabilities, fallback, cache context."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from kvactors.core.layouts import ShapeDesc
from kvactors.devices.base import IPCHandle
from kvactors.devices.musa import MusaBackend
from kvactors.devices.musa.contract import (
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
from kvactors.testing import FakeDeviceTensor, FakeVendor, fake_vendor


@pytest.mark.parametrize("ctor", [True, False])
def test_tensor_from_ptr_both_routes(ctor: bool) -> None:
    with fake_vendor("musa", vendor_constructor=ctor) as fake:
        b = MusaBackend()
        dev = fake.to_device(torch.arange(24.0))
        v = b.tensor_from_ptr(
            dev.data_ptr(), (2, 3), torch.float32, stride=(4, 1), storage_offset=1
        )
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
    shape = ShapeDesc(
        kv_size=1, nl=2, nb=6, bs=4, nh=1, hs=8, element_size=2, block_stride_elems=40
    )
    assert paged_view_geometry(3, shape) == ((6, 4, 8), (40, 8, 1))
    assert group_pointers([101, 102, 201, 202], 9, 2) == [[101, 102], [201, 202]]
    assert check_pointer_tensor(torch.tensor([1, 2, 3, 4]), 9, 2) == (1, 2, 3, 4)
    with pytest.raises(TransferValidationError):
        check_pointer_tensor(torch.tensor([1, 2, 3]), 9, 2)
    with pytest.raises(OperandTypeError):
        check_pointer_tensor(torch.tensor([1.0, 2.0]), 1, 2)


NL, NB, BS, NH, HS = 2, 8, 4, 2, 8
ON = {"LMCACHE_MUSA_NATIVE_KV_TRANSFER": "1"}


class CountingNative:
    """A native that moves the bytes itself (kvactors' reference loops) and counts, or declines."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.calls = 0
        self.moved = 0

    def transfer(self, plan: Any, paged: object, objects: Any) -> bool:
        from kvactors.kernels.reference import run_reference

        self.calls += 1
        if not self.accept:
            return False
        run_reference(plan, paged, list(objects))
        self.moved += 1
        return True


def _nhd_transfer(
    backend: MusaBackend, fake: FakeVendor, *, fmt: int = 1, skip: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """D2H of blocks (3, 5, 0, 6) through Runtime(backend); returns (got, want) chunks."""
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

    cpu = [torch.randn(2, NB, BS, NH, HS) for _ in range(NL)]
    ids = [3, 5, 0, 6]
    want = [
        torch.stack([t[:, ids[c : c + 2]].reshape(2, 2 * BS, NH * HS) for t in cpu], dim=1)
        for c in (0, 2)
    ]
    objs = [torch.zeros(2, NL, 2 * BS, NH * HS) for _ in range(2)]
    req = TransferRequest(
        fmt=fmt,
        direction=1,
        block_ids=tuple(ids),
        chunk_size=2 * BS,
        skip_blocks=skip,
        shape=ShapeDesc(
            kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=4, dtype="float32"
        ),
    )
    with Runtime(backend) as rt:
        rt.transfer(req, [fake.to_device(t) for t in cpu], objs)
    return objs, want


def test_native_moves_the_bytes_when_opted_in(fake_musa: FakeVendor) -> None:
    native = CountingNative()
    backend = MusaBackend(native=native, env=ON)
    got, want = _nhd_transfer(backend, fake_musa)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (native.calls, native.moved) == (1, 1)
    c = backend.native.counters
    assert (c.native_transfers, c.native_declined) == (1, 0)


def test_declining_native_falls_back_to_the_torch_kernel(fake_musa: FakeVendor) -> None:
    native = CountingNative(accept=False)
    backend = MusaBackend(native=native, env=ON)
    got, want = _nhd_transfer(backend, fake_musa)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # the fallback moved it
    assert (native.calls, native.moved) == (1, 0)
    assert backend.native.counters.native_declined == 1


def test_native_needs_the_opt_in(fake_musa: FakeVendor) -> None:
    native = CountingNative()
    got, want = _nhd_transfer(MusaBackend(native=native, env={}), fake_musa)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert native.calls == 0


def test_native_is_registered_through_the_entry_point(
    fake_musa: FakeVendor, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented extension point: ``musa`` in the ``kvactors.native_kernels`` group."""
    (tmp_path / "counting_native_kernels.py").write_text(
        "from tests.devices.test_musa import CountingNative\n"
        "INSTANCES = []\n"
        "def make():\n"
        "    n = CountingNative()\n"
        "    INSTANCES.append(n)\n"
        "    return n\n"
    )
    dist = tmp_path / "counting_native_kernels-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: counting-native-kernels\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[kvactors.native_kernels]\nmusa = counting_native_kernels:make\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import counting_native_kernels as registered  # type: ignore[import-not-found]

    got, want = _nhd_transfer(MusaBackend(env=ON), fake_musa)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert [n.moved for n in registered.INSTANCES] == [1]


@pytest.mark.parametrize("why", ["kv-list-format", "d2h-skip"])
def test_ineligible_plans_never_reach_the_native(fake_musa: FakeVendor, why: str) -> None:
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

    native = CountingNative()
    backend = MusaBackend(native=native, env=ON)
    if why == "d2h-skip":
        got, want = _nhd_transfer(backend, fake_musa, skip=1)
        assert torch.equal(got[1], want[1])
    else:
        k = [fake_musa.to_device(torch.randn(NB, BS, NH, HS)) for _ in range(NL)]
        v = [fake_musa.to_device(torch.randn(NB, BS, NH, HS)) for _ in range(NL)]
        req = TransferRequest(
            fmt=9,
            direction=1,
            block_ids=(1, 2),
            chunk_size=2 * BS,
            shape=ShapeDesc(
                kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=4, dtype="float32"
            ),
        )
        with Runtime(backend) as rt:
            rt.transfer(req, [k, v], [torch.zeros(2, NL, 2 * BS, NH * HS)])
    assert native.calls == 0


@pytest.mark.parametrize("fmt", [6, 2, 0, 7])
def test_runtime_refuses_formats_lmcache_musa_refuses(fake_musa: FakeVendor, fmt: int) -> None:
    """HND and the other formats LMCache's MUSA MP path refuses fail before memory is touched."""
    with pytest.raises(TransferValidationError, match="MUSA MP block transfer supports only"):
        _nhd_transfer(MusaBackend(), fake_musa, fmt=fmt)
