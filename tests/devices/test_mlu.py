"""MLU backend specifics: refusals, handles, probe, transfer mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.devices.base import IPCHandle
from kvactors.devices.mlu import MluBackend
from kvactors.errors import InvalidPointerError, UnsupportedOperationError

if TYPE_CHECKING:
    from kvactors.testing import FakeVendor


def test_handles(fake_mlu: FakeVendor) -> None:
    b = MluBackend()
    default = torch.mlu.default_stream(0)  # type: ignore[attr-defined]
    assert b.stream_from_handle(0, 0) is default
    assert b.stream_handle(default) != 0
    s = b.new_stream(0)
    assert b.stream_from_handle(b.stream_handle(s), 0) is s
    assert b.current_stream_handle(0) == b.stream_handle(default)
    for pseudo in (1, 2):
        with pytest.raises(UnsupportedOperationError, match="pseudo-queue"):
            b.stream_from_handle(pseudo, 0)
    with pytest.raises(InvalidPointerError):
        b.stream_from_handle(0, 3)
    assert b.device(0).type == "mlu"


def test_refusals_name_the_reason(fake_mlu: FakeVendor) -> None:
    b = MluBackend()
    dev = fake_mlu.to_device(torch.zeros(4))
    with pytest.raises(UnsupportedOperationError, match="host pointers"):
        b.tensor_from_ptr(dev.data_ptr(), (4,), torch.float32)
    with pytest.raises(UnsupportedOperationError, match="IPC"):
        b.ipc_export(dev)
    with pytest.raises(UnsupportedOperationError, match="IPC"):
        b.ipc_open(IPCHandle(backend="mlu", name="x", dtype="float32", shape=(4,), stride=(1,)))
    with pytest.raises(UnsupportedOperationError, match="host memory"):
        b.register_host(torch.zeros(4))
    assert b.transfer_mode() == "engine_driven"
    with pytest.raises(UnsupportedOperationError, match="LMCache-driven"):
        b.transfer_mode("lmcache_driven")
    with pytest.raises(ValueError, match="unknown"):
        b.transfer_mode("bogus")


def test_pin_and_copy_policy(fake_mlu: FakeVendor) -> None:
    b = MluBackend()
    host = b.pin(torch.zeros(4, 8))
    assert host.is_pinned()
    assert b.pin(host) is host
    src = fake_mlu.to_device(torch.ones(4, 4))
    assert b.must_block(host[:, :4], src)
    assert not b.must_block(torch.zeros(4, 4), src)
    assert b.must_block(torch.zeros(4, 4, dtype=torch.float64), src)
    assert not b.must_block(src, host[:, :4])  # H2D is not the hazard


def test_probe_details_and_device_errors(fake_mlu: FakeVendor) -> None:
    p = MluBackend().probe()
    assert p.available
    assert p.details["device_count"] == "1"
    b = MluBackend()
    s = b.new_stream(0)
    fake_mlu.inject_error(s, "cnrt failure")  # type: ignore[arg-type]
    from kvactors.errors import DeviceOpError

    with pytest.raises(DeviceOpError, match="cnrt failure"):
        b.synchronize(s)


@pytest.mark.parametrize("opted_in", [True, False])
def test_native_extension_point_on_mlu(fake_mlu: FakeVendor, opted_in: bool) -> None:
    """``KVACTORS_MLU_NATIVE_KV_TRANSFER=1`` + a native: it moves the bytes; off: never called."""
    from kvactors.core.layouts import ShapeDesc
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime
    from tests.devices.test_musa import CountingNative

    native = CountingNative()
    env = {"KVACTORS_MLU_NATIVE_KV_TRANSFER": "1"} if opted_in else {}
    backend = MluBackend(native=native, env=env)
    cpu = [torch.randn(2, 8, 2, 4, 8) for _ in range(2)]  # HND, as vLLM-MLU allocates
    objs = [torch.zeros(2, 2, 8, 16)]
    req = TransferRequest(
        fmt=6,
        direction=1,
        block_ids=(5, 1),
        chunk_size=8,
        shape=ShapeDesc(kv_size=2, nl=2, nb=8, bs=4, nh=2, hs=8, element_size=4, dtype="float32"),
    )
    with Runtime(backend) as rt:
        rt.transfer(req, [fake_mlu.to_device(t) for t in cpu], objs)
    want = torch.stack([t[:, [5, 1]].permute(0, 1, 3, 2, 4).reshape(2, 8, 16) for t in cpu], dim=1)
    assert torch.equal(objs[0], want)
    assert native.moved == (1 if opted_in else 0)
    assert backend.native.counters.native_transfers == native.moved


@pytest.mark.parametrize("opted_in", [True, False])
def test_a_native_hook_with_no_native_to_run_is_never_entered(
    fake_mlu: FakeVendor, opted_in: bool
) -> None:
    """No native registered (opted in or not): the runtime never calls the backend's
    ``transfer_kernel`` hook, so the hook costs a transfer nothing."""
    from kvactors.core.layouts import ShapeDesc
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

    env = {"KVACTORS_MLU_NATIVE_KV_TRANSFER": "1"} if opted_in else {}
    backend = MluBackend(env=env)
    entered: list[bool] = []
    slot_kernel = backend.native.kernel

    def spy(*args: Any) -> Any:  # the slot's own method, counted
        entered.append(True)
        return slot_kernel(*args)

    backend.native.kernel = spy  # type: ignore[method-assign,assignment]
    cpu = [torch.randn(2, 8, 2, 4, 8) for _ in range(2)]
    objs = [torch.zeros(2, 2, 8, 16)]
    req = TransferRequest(
        fmt=6,
        direction=1,
        block_ids=(5, 1),
        chunk_size=8,
        shape=ShapeDesc(kv_size=2, nl=2, nb=8, bs=4, nh=2, hs=8, element_size=4, dtype="float32"),
    )
    with Runtime(backend) as rt:
        rt.transfer(req, [fake_mlu.to_device(t) for t in cpu], objs)
        assert entered == []
        # An instance whose hook is replaced after the start: called from then on.
        hooked: list[bool] = []
        hook = backend.transfer_kernel

        def own(*args: Any) -> Any:
            hooked.append(True)
            return hook(*args)

        backend.transfer_kernel = own  # type: ignore[method-assign,assignment]
        rt.transfer(req, [fake_mlu.to_device(t) for t in cpu], objs)
    assert hooked == [True]
