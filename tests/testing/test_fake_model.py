"""What the fakes model beyond streams: autograd state, allocator statistics, factories, shape.

Each test here closes a gap LMCache's own device suites found in the fakes (issue 42):
queued work runs under its caller's inference and grad mode; the memory model keeps the
allocator statistics the vendor modules expose; every torch factory accepts a fake device
through one path, and the vendor's seeding calls exist; ``shape`` is a ``torch.Size``.
"""

from __future__ import annotations

import pytest
import torch

from kvactors.testing import fake_vendor

KINDS = ["mlu", "musa"]


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
