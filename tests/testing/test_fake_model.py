"""What the fakes model beyond streams: autograd state, allocator statistics, factories, shape.

Each test here closes a gap LMCache's own device suites found in the fakes (issue 42):
queued work runs under its caller's inference and grad mode; the memory model keeps the
allocator statistics the vendor modules expose; every torch factory accepts a fake device
through one path, and the vendor's seeding calls exist; ``shape`` is a ``torch.Size``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kvactors.testing import FakeDeviceError, FakeDeviceTensor, fake_vendor
from kvactors.testing.pytest_plugin import require_torch_devices

KINDS = ["mlu", "musa"]
PROCESS_KIND = os.environ.get("KVACTORS_FAKE_VENDOR", "mlu")


# ---- gap 1: queued work runs under its caller's autograd state ---------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_work_queued_under_inference_mode_fills_inference_tensors(kind: str) -> None:
    """Outputs allocated on the caller's thread under ``inference_mode`` are inference
    tensors; the worker that fills them must run in inference mode too (LMCache's gather and
    scatter run so), and the stream must not be left with a sticky error."""
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        src = fake.to_device(torch.arange(6.0))
        with torch.inference_mode():
            dst = fake.empty((6,))
            assert dst.is_inference()
            dst.copy_(src)  # device to device: queued on the worker
            doubled = src * 2  # a kernel whose output the worker fills
            host = torch.empty(6)
            host.copy_(doubled)  # device to host, blocking
        mod.synchronize()
        assert torch.equal(fake.peek(dst), torch.arange(6.0))
        assert torch.equal(host, torch.arange(6.0) * 2)
        assert all(s.query() for s in fake.streams())


@pytest.mark.parametrize("kind", KINDS)
def test_work_queued_under_no_grad_runs_without_grad(kind: str) -> None:
    """An in-place update of a leaf that requires grad is legal only under ``no_grad`` (an
    optimizer step): queued on the worker, it must keep the caller's grad mode."""
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        w = fake.to_device(torch.zeros(4)).requires_grad_()
        with torch.no_grad():
            w.add_(1.0)
        mod.synchronize()
        assert torch.equal(fake.peek(w).detach(), torch.ones(4))


@pytest.mark.parametrize("kind", KINDS)
def test_work_queued_with_grad_enabled_keeps_autograd_checks(kind: str) -> None:
    """The caller's grad mode is carried, not switched off: the same update outside
    ``no_grad`` still fails, as autograd says, at the next synchronize."""
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        w = fake.to_device(torch.zeros(4)).requires_grad_()
        w.add_(1.0)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            mod.synchronize()


# ---- gap 2: allocator statistics kept by the fake memory model ---------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_allocator_statistics_follow_allocations_frees_and_resets(kind: str) -> None:
    with fake_vendor(kind) as fake:
        mod = getattr(torch, kind)
        base = mod.memory_allocated()
        a = fake.empty((1000,))  # 4000 bytes: one 4096-byte block
        assert mod.memory_allocated() == base + 4096
        mod.reset_peak_memory_stats()
        assert mod.max_memory_allocated() == base + 4096
        b = fake.empty((10,))  # 40 bytes: the smallest (512-byte) block
        assert mod.memory_allocated() == base + 4096 + 512
        peak = mod.max_memory_allocated()
        assert peak == base + 4096 + 512
        del b
        assert mod.memory_allocated() == base + 4096
        assert mod.max_memory_allocated() == peak  # a free keeps the peak
        assert mod.memory_reserved() == mod.max_memory_reserved() == peak  # cached, not freed
        assert mod.mem_get_info()[0] == mod.mem_get_info()[1] - peak
        mod.reset_peak_memory_stats()
        assert mod.max_memory_allocated() == base + 4096
        mod.empty_cache()
        assert mod.memory_reserved() == mod.memory_allocated() == base + 4096
        stats = mod.memory_stats()
        assert stats["allocated_bytes.all.current"] == base + 4096
        assert stats["requested_bytes.all.current"] == 4000
        assert stats["allocation.all.current"] == 1
        assert stats["allocated_bytes.all.freed"] == 512
        assert stats["allocated_bytes.all.allocated"] == 4096 + 512
        mod.reset_accumulated_memory_stats()
        assert mod.memory_stats()["allocated_bytes.all.allocated"] == 0
        assert "allocated_bytes.all.current" in mod.memory_summary()
        del a
        assert mod.memory_allocated() == base


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_outputs_and_temporaries_count_until_freed(kind: str) -> None:
    """An op's output is an allocation from the moment the op is queued, and it is freed
    when the program drops its last tensor over it, even while queued work still uses the
    memory (a caching allocator reuses such a block for later work of the stream)."""
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        x = fake.to_device(torch.ones(1024))  # 4096 bytes
        start = mod.memory_allocated()
        mod.reset_peak_memory_stats()
        y = (x * 2).sum()  # a temporary (x * 2) and the output, queued
        assert mod.max_memory_allocated() == start + 4096 + 512
        assert mod.memory_allocated() == start + 512  # the temporary is gone, not yet run
        view = x[:512]
        del x
        assert mod.memory_allocated() == start + 512  # a view holds the allocation
        del view
        assert mod.memory_allocated() == 512
        mod.synchronize()
        assert y.item() == 2048.0  # the queued work still had its memory
        del y
        assert mod.memory_allocated() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_peak_counts_only_what_the_program_still_holds(kind: str) -> None:
    """A peak is taken at an allocation, after every free before it that nothing read: one
    whose last tensor (a view here) died while queued work still uses the memory, and one
    whose tensor moved to other memory with ``set_`` (which torch runs without asking the
    tensor's type)."""
    with fake_vendor(kind, lazy=True) as fake:
        mod = getattr(torch, kind)
        a = fake.empty((1024,))  # 4096 bytes
        view = a[:10]
        del a
        view.fill_(1.0)  # queued, not run: the work holds the memory
        mod.reset_peak_memory_stats()
        del view  # freed; nothing reads the statistics before the next allocation
        b = fake.empty((2048,))  # 8192 bytes
        assert mod.max_memory_allocated() == 8192
        c = fake.empty((1024,))  # 4096 bytes
        mod.reset_peak_memory_stats()
        c.set_(b.untyped_storage())  # c's own memory has no tensor left
        d = fake.empty((2048,))  # 8192 bytes
        assert mod.max_memory_allocated() == 8192 + 8192
        del b, c, d
        assert mod.memory_allocated() == 0
        mod.synchronize()


# ---- gap 3: every factory accepts a fake device, through one path; seeding --------------


def test_every_torch_factory_with_a_device_argument_is_covered() -> None:
    """The factory list comes from aten's schemas, not from a list kept by hand."""
    from kvactors.testing._assembly import factories

    names, random = factories()
    for name in (
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "arange",
        "full",
        "rand",
        "randn",
        "randint",
        "rand_like",
        "tril_indices",
        "hann_window",
        "asarray",
    ):
        assert name in names
    assert {"rand", "randn", "randint", "randperm", "normal"} <= random


def _factory_calls(dev: str) -> dict[str, torch.Tensor]:
    return {
        "randperm": torch.randperm(16, device=dev),
        "linspace": torch.linspace(0, 1, 5, device=dev),
        "logspace": torch.logspace(0, 2, 3, device=dev),
        "eye": torch.eye(3, device=dev),
        "arange": torch.arange(6, device=dev),
        "range": torch.arange(0, 10, 2, device=dev),
        "full": torch.full((2, 2), 7.0, device=dev),
        "zeros": torch.zeros(3, device=dev),
        "rand": torch.rand(4, device=dev),
        "randn": torch.randn(4, device=dev),
        "randint": torch.randint(0, 9, (4,), device=dev),
        "normal": torch.normal(0.0, 1.0, (4,), device=dev),
        "rand_like": torch.rand_like(torch.empty(3), device=dev),
        "tril_indices": torch.tril_indices(3, 3, device=dev),
        "scalar_tensor": torch.scalar_tensor(2.0, device=dev),
        "asarray": torch.asarray([1, 2], device=dev),
        "new_zeros": torch.empty(1).new_zeros(2, device=dev),
        "new_full": torch.empty(1).new_full((2,), 3.0, device=dev),
    }


@pytest.mark.parametrize("kind", KINDS)
def test_factories_make_device_tensors_on_a_fake_device(kind: str) -> None:
    require_torch_devices(kind)
    with fake_vendor(kind):
        dev = torch.device(kind, 0)
        made = _factory_calls(f"{kind}:0")
        for name, t in made.items():
            assert isinstance(t, FakeDeviceTensor), name
            assert t.device == dev, name
        assert sorted(made["randperm"].cpu().tolist()) == list(range(16))
        assert torch.equal(made["eye"].cpu(), torch.eye(3))
        assert torch.equal(made["linspace"].cpu(), torch.linspace(0, 1, 5))
        assert torch.equal(made["tril_indices"].cpu(), torch.tril_indices(3, 3))
        before = getattr(torch, kind).memory_allocated()
        keep = torch.eye(16, device=dev)
        assert getattr(torch, kind).memory_allocated() == before + 1024
        del keep


@pytest.mark.parametrize("kind", KINDS)
def test_vendor_seeding_calls_drive_the_devices_random_factories(kind: str) -> None:
    require_torch_devices(kind)
    with fake_vendor(kind, devices=2):
        mod = getattr(torch, kind)
        mod.manual_seed(1234)
        assert mod.initial_seed() == 1234
        first = torch.randn(8, device=kind).cpu()
        perm = torch.randperm(32, device=kind).cpu()
        mod.manual_seed(1234)
        assert torch.equal(torch.randn(8, device=kind).cpu(), first)
        assert torch.equal(torch.randperm(32, device=kind).cpu(), perm)
        state = mod.get_rng_state()
        again = torch.rand(4, device=kind).cpu()
        mod.set_rng_state(state)
        assert torch.equal(torch.rand(4, device=kind).cpu(), again)
        torch.manual_seed(99)  # torch seeds the private device's generators through the fake
        assert [g.initial_seed() for g in mod.default_generators] == [99, 99]
        mod.manual_seed_all(5)
        assert torch.equal(
            torch.rand(3, device=f"{kind}:1").cpu(), torch.rand(3, device=f"{kind}:0").cpu()
        )
        mod.seed()
        assert mod.initial_seed() != 5
        assert len(mod.get_rng_state_all()) == 2


# ---- gap 5: shape is a torch.Size ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_shape_is_a_torch_size(kind: str) -> None:
    with fake_vendor(kind) as fake:
        t = fake.empty((2, 3))
        for shape in (t.shape, t.T.shape, t[0].shape, (t * 2).shape, t.view(6).shape):
            assert type(shape) is torch.Size
        assert t.shape == t.size() == torch.Size([2, 3])
        assert t.shape.numel() == 6


# ---- gap 4: IPC handles open in a spawned child (knob cross_process) ---------------------


def _export(kind: str, t: torch.Tensor) -> object:
    if kind == "musa":
        return torch.musa.ipc.export_tensor(t)  # type: ignore[attr-defined]
    return t.untyped_storage()._share_mlu_()  # type: ignore[attr-defined]


def _open(kind: str, handle: Any) -> tuple[torch.Tensor, Any]:
    """(a device tensor over the exported memory, what keeps it open)."""
    if kind == "musa":
        owner = torch.musa.ipc.open_tensor(handle)  # type: ignore[attr-defined]
        return owner.tensor, owner
    storage = torch.UntypedStorage._new_shared_mlu(*handle)  # type: ignore[attr-defined]
    view = torch.empty(0, device=f"{kind}:0").set_(storage).view(torch.float32)
    return view, storage


def _memory_child(kind: str, kept: Any, released: Any, inbox: Any, outbox: Any) -> None:
    with fake_vendor(kind, cross_process=True) as fake:
        t, owner = _open(kind, kept)
        outbox.put(float(fake.peek(t).sum()))
        t.fill_(7.0)  # a kernel on the child's stream, into the parent's memory
        getattr(torch, kind).synchronize()
        outbox.put("written")
        del t, owner
        inbox.get(timeout=60)  # the parent released the second export
        try:
            _open(kind, released)
        except FakeDeviceError as exc:
            outbox.put(str(exc))
        else:
            outbox.put("opened")


@pytest.mark.parametrize("kind", KINDS)
def test_exported_memory_opens_in_a_spawned_child_with_the_same_lifetime_rules(
    kind: str,
) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    with fake_vendor(kind, cross_process=True) as fake:
        kept = fake.to_device(torch.arange(16.0))
        doomed = fake.to_device(torch.ones(4))
        handles = (_export(kind, kept), _export(kind, doomed))
        assert torch.equal(fake.peek(kept), torch.arange(16.0))  # moved, bytes intact
        child = ctx.Process(target=_memory_child, args=(kind, *handles, inbox, outbox))
        child.start()
        try:
            assert outbox.get(timeout=60) == float(torch.arange(16.0).sum())
            assert outbox.get(timeout=60) == "written"
            assert torch.equal(kept.cpu(), torch.full((16,), 7.0))  # one memory, two processes
            del doomed
            inbox.put("released")
            assert outbox.get(timeout=60) == "unknown or released IPC memory handle"
        finally:
            child.join(60)
        assert child.exitcode == 0


def _event_child(kind: str, mem: Any, ev_handle: bytes, inbox: Any, outbox: Any) -> None:
    with fake_vendor(kind, cross_process=True) as fake:
        mod = getattr(torch, kind)
        src, owner = _open(kind, mem)
        ev = mod.Event.from_ipc_handle(0, ev_handle)
        outbox.put(ev.query())  # the parent's stream is held: not reached yet
        consumer = mod.Stream()
        dst = fake.empty((4,))
        consumer.wait_event(ev)
        with mod.stream(consumer):
            dst.copy_(src)  # ordered after the parent's fill by the event only
        inbox.get(timeout=60)  # the parent let its stream run
        consumer.synchronize()
        outbox.put(fake.peek(dst).tolist())
        assert ev.query()
        inbox.get(timeout=60)  # the parent released the event
        try:
            ev.query()
        except FakeDeviceError as exc:
            outbox.put(str(exc))
        del src, owner


def test_exported_event_orders_a_spawned_childs_stream_after_the_exporters() -> None:
    import multiprocessing
    import threading

    kind = PROCESS_KIND
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    with fake_vendor(kind, cross_process=True) as fake:
        mod = getattr(torch, kind)
        mem = fake.to_device(torch.zeros(4))
        handle = _export(kind, mem)
        producer = mod.Stream()
        gate = threading.Event()
        producer.enqueue(gate.wait)  # holds the producer's stream until the test opens it
        with mod.stream(producer):
            mem.fill_(5.0)
        ev = mod.Event(interprocess=True)
        ev.record(producer)
        child = ctx.Process(
            target=_event_child, args=(kind, handle, ev.ipc_handle(), inbox, outbox)
        )
        child.start()
        try:
            assert outbox.get(timeout=60) is False
            gate.set()
            inbox.put("go")
            assert outbox.get(timeout=60) == [5.0] * 4
            del ev
            inbox.put("released")
            assert outbox.get(timeout=60) == "the exporter of this IPC event was released"
        finally:
            gate.set()
            child.join(60)
        assert child.exitcode == 0
