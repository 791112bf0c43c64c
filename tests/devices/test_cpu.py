"""The CPU backend: pointer views with validation, shared-memory IPC across processes."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from kvactors.core.pointers import required_nbytes
from kvactors.devices.cpu import CpuBackend
from kvactors.devices.cpu.shm import SEGMENT_PREFIX
from kvactors.errors import BackendUnavailableError, InvalidPointerError, IPCError


@pytest.fixture
def cpu() -> CpuBackend:
    return CpuBackend()


def test_probe_and_require(cpu: CpuBackend) -> None:
    assert cpu.probe().available
    cpu.require()


def test_tensor_from_ptr_is_a_non_owning_view(cpu: CpuBackend) -> None:
    base = torch.arange(24, dtype=torch.float32)
    view = cpu.tensor_from_ptr(
        base.data_ptr(), (2, 3), torch.float32, stride=(4, 1), storage_offset=2, nbytes=96
    )
    assert view.tolist() == [[2.0, 3.0, 4.0], [6.0, 7.0, 8.0]]
    view[1, 1] = -1
    assert base[7].item() == -1.0
    assert required_nbytes((2, 3), (4, 1), 0, 4) == 28


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ptr": 0}, "ptr"),
        ({"ptr": -8}, "ptr"),
        ({"shape": (2, -1)}, "shape"),
        ({"stride": (1,)}, "stride"),
        ({"stride": (-1, 1)}, "stride"),
        ({"storage_offset": -1}, "storage_offset"),
        ({"nbytes": 8}, "nbytes"),
        ({"device": "meta"}, "device"),
    ],
)
def test_tensor_from_ptr_rejects_bad_input(
    cpu: CpuBackend, kwargs: dict[str, object], field: str
) -> None:
    base = torch.zeros(16)
    args: dict[str, object] = {"ptr": base.data_ptr(), "shape": (2, 3), "nbytes": 64}
    args.update(kwargs)
    ptr, shape = args.pop("ptr"), args.pop("shape")
    before = base.clone()
    with pytest.raises(InvalidPointerError) as ei:
        cpu.tensor_from_ptr(ptr, shape, torch.float32, **args)  # type: ignore[arg-type]
    assert ei.value.field == field
    assert torch.equal(base, before)


def test_export_requires_shared_memory(cpu: CpuBackend) -> None:
    with pytest.raises(IPCError, match="alloc_shared"):
        cpu.ipc_export(torch.zeros(4))


def test_unknown_backend_is_unavailable_with_reason() -> None:
    class Missing(CpuBackend):
        kind = "nothing"

        def probe(self):  # type: ignore[no-untyped-def]
            from kvactors.devices.base import Probe

            return Probe(backend="nothing", available=False, reason="module 'x' not importable")

    with pytest.raises(BackendUnavailableError, match="module 'x' not importable"):
        Missing().require()


def _child(handle_bytes: bytes, q: mp.Queue[object]) -> None:
    import msgspec

    from kvactors.devices.base import IPCHandle
    from kvactors.runtime import Runtime

    handle = msgspec.msgpack.decode(handle_bytes, type=IPCHandle)
    with Runtime("cpu") as rt:
        view = rt.open_ipc(handle, context_id=1)
        q.put(view.sum().item())
        view.mul_(2).add_(1)
        del view
        closed = rt.close_ipc_context(1)
        q.put(closed.owners_closed)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _shm_names() -> set[str]:
    # This process's segments only (names carry the creator's pid): other test runs on the
    # machine create and remove their own meanwhile.
    own = f"{SEGMENT_PREFIX}{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(own)}


def test_cross_process_export_write_close_leaves_nothing(cpu: CpuBackend) -> None:
    from multiprocessing import resource_tracker

    import msgspec

    resource_tracker.ensure_running()  # long-lived by design; not a leak of this test
    fds0, shm0 = _open_fds(), _shm_names()
    shared = cpu.alloc_shared((4, 8), torch.float32)
    assert shared.tensor is not None
    shared.tensor.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
    part = shared.tensor[1:3]  # a strided sub-view with a storage offset
    handle = cpu.ipc_export(part)
    assert handle.storage_offset == 8
    ctx = mp.get_context("spawn")
    q: mp.Queue[object] = ctx.Queue()
    p = ctx.Process(target=_child, args=(msgspec.msgpack.encode(handle), q))
    p.start()
    seen = q.get(timeout=60)
    owners_closed = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    p.close()
    assert seen == float(sum(range(8, 24)))
    assert owners_closed == 1
    expect = torch.arange(32, dtype=torch.float32).view(4, 8)
    expect[1:3] = expect[1:3] * 2 + 1
    assert torch.equal(shared.tensor, expect)
    del part
    shared.close()
    q.close()
    q.join_thread()
    del q, ctx
    import gc

    gc.collect()
    assert _shm_names() == shm0
    assert _open_fds() <= fds0
