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
