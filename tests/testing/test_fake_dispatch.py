"""The fake tensor's dispatch table: one handler per torch function, resolved on its first call.

A handler remembered per function must not remember what depends on the call: whether the
tensor is a device tensor, whether indexing or ``reshape`` makes a view or runs a kernel,
whether ``==`` gets a tensor, where ``to`` goes, and which errors a bad call raises. Each
test calls the same torch function both ways, in both orders, on a lazy fake (device work runs
only once something waits), and checks what a card would do: a kernel's output is device
memory the host cannot read before the stream ran, a view shares the memory and runs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.testing import FakeDeviceTensor, fake_vendor

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.testing.vendor import FakeVendor

KINDS = ["mlu", "musa"]


def _base(fake: FakeVendor) -> FakeDeviceTensor:
    t = fake.to_device(torch.arange(12.0).reshape(3, 4))
    getattr(torch, fake.kind).synchronize()
    return t


def _is_view(fake: FakeVendor, base: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` shows a later write to ``base`` (it shares the memory)."""
    before = fake.peek(out)
    base.add_(100.0)  # queued on the stream
    getattr(torch, fake.kind).synchronize()
    return not torch.equal(fake.peek(out), before)


def _kernel_ran_later(fake: FakeVendor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Call ``make``; assert it queued one kernel (still queued: the stream is lazy) and
    returned its output as device memory."""
    mod = getattr(torch, fake.kind)
    mod.synchronize()
    with fake.counting() as ops:
        out = make()
    assert isinstance(out, FakeDeviceTensor)
    assert ops.counts.launches == 1
    assert ops.counts.syncs == 0
    assert not mod.current_stream().query()
    return out


def _view_at_once(fake: FakeVendor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Call ``make``; assert it ran nothing and returned device memory."""
    mod = getattr(torch, fake.kind)
    mod.synchronize()
    with fake.counting() as ops:
        out = make()
    assert isinstance(out, FakeDeviceTensor)
    assert ops.counts.launches == 0
    assert ops.counts.syncs == 0
    assert mod.current_stream().query()
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("view_first", [True, False])
def test_indexing_is_a_view_or_a_kernel_by_its_index(kind: str, view_first: bool) -> None:
    """``t[1]`` / ``t[:, 1:3]`` are views; ``t[index_tensor]`` gathers on the device."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)
        idx = fake.to_device(torch.tensor([2, 0]))

        def basic() -> None:
            v = _view_at_once(fake, lambda: t[1])
            w = _view_at_once(fake, lambda: t[:, 1:3])
            assert _is_view(fake, t, v)
            assert _is_view(fake, t, w)

        def advanced() -> None:
            g = _kernel_ran_later(fake, lambda: t[idx])
            getattr(torch, kind).synchronize()
            expected = fake.peek(t)[torch.tensor([2, 0])]
            assert torch.equal(fake.peek(g), expected)
            assert not _is_view(fake, t, g)

        calls = [basic, advanced] if view_first else [advanced, basic]
        for call in calls * 2:
            call()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("view_first", [True, False])
def test_reshape_is_a_view_or_a_kernel_by_its_strides(kind: str, view_first: bool) -> None:
    """The same ``Tensor.reshape``: a view of a contiguous tensor, a copy kernel of a
    transposed one."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)

        def view() -> None:
            assert _is_view(fake, t, _view_at_once(fake, lambda: t.reshape(-1)))

        def copy() -> None:
            r = _kernel_ran_later(fake, lambda: t.t().reshape(-1))
            getattr(torch, kind).synchronize()
            assert torch.equal(fake.peek(r), fake.peek(t).t().reshape(-1))

        for call in ([view, copy] if view_first else [copy, view]) * 2:
            call()


@pytest.mark.parametrize("kind", KINDS)
def test_a_function_on_a_device_tensor_and_on_host_tensors(kind: str) -> None:
    """``torch.mul`` with a device operand queues a kernel; the same function on host
    tensors alone runs at once on the host, before and after."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)
        host = torch.arange(12.0).reshape(3, 4)
        for _ in range(2):
            assert torch.equal(torch.mul(host, 2.0), host * 2)
            out = _kernel_ran_later(fake, lambda: torch.mul(t, 2.0))
            assert not isinstance(torch.mul(host, 2.0), FakeDeviceTensor)
            # A host operand of a device kernel is uploaded; the answer is device memory.
            mixed = torch.mul(host, t)
            assert isinstance(mixed, FakeDeviceTensor)
            assert torch.equal(out.cpu(), host * 2)  # a host read waits for the stream
            assert torch.equal(mixed.cpu(), host * fake.peek(t))


@pytest.mark.parametrize("kind", KINDS)
def test_eq_answers_by_its_operand(kind: str) -> None:
    """``t == None`` is a bool from Python's fallback; ``t == u`` is a device kernel."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)
        u = _base(fake)
        for _ in range(2):
            assert (t == None) is False  # noqa: E711 - the operator, not an identity test
            eq = _kernel_ran_later(fake, lambda: t == u)
            assert eq.dtype == torch.bool
            assert bool(eq.all())


@pytest.mark.parametrize("kind", KINDS)
def test_to_goes_where_its_arguments_say(kind: str) -> None:
    """One ``Tensor.to``: the same dtype is the tensor itself, another dtype a kernel on the
    device, ``"cpu"`` a host copy that waits for the stream."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)
        expected = torch.arange(12.0).reshape(3, 4)
        for _ in range(2):
            assert t.to(torch.float32) is t
            half = _kernel_ran_later(fake, lambda: t.to(torch.float16))
            assert half.dtype == torch.float16
            with fake.counting() as ops:
                host = t.to("cpu")
            assert not isinstance(host, FakeDeviceTensor)
            assert ops.counts.syncs == 1  # a host read waits for the stream first
            assert torch.equal(host, expected)
            assert torch.equal(half.cpu(), expected.half())


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_and_views_run_nothing_and_reject_as_torch_does(kind: str) -> None:
    """Metadata queries answer at once with the memory's numbers; the same query or view
    with arguments torch rejects raises torch's error, after good calls and before them."""
    with fake_vendor(kind, lazy=True) as fake:
        t = _base(fake)
        host = torch.arange(12.0).reshape(3, 4)
        for _ in range(2):
            with pytest.raises(IndexError):
                t.size(5)
            with pytest.raises(RuntimeError, match="view"):
                t.t().view(-1)  # not viewable: torch says use reshape
            with fake.counting() as ops:
                assert t.size() == host.size()
                assert t.size(1) == 4
                assert t.stride() == host.stride()
                assert t.t().stride() == host.t().stride()
                assert t.dim() == 2
                assert t.numel() == 12
                assert t.element_size() == 4
                assert t.storage_offset() == 0
                assert t[1].storage_offset() == 4
                assert t.is_contiguous()
                assert not t.t().is_contiguous()
                assert not t.is_inference()
                assert len(t) == 3
                assert t[1].data_ptr() == t.data_ptr() + 16
                assert t.untyped_storage().nbytes() == 48
                parts = t.split(1)
                assert all(isinstance(p, FakeDeviceTensor) for p in parts)
                assert [p.shape for p in parts] == [torch.Size([1, 4])] * 3
                assert t.T.shape == (4, 3)
                assert isinstance(t.T, FakeDeviceTensor)
                assert isinstance(t.shape, torch.Size)
            assert ops.counts.launches == 0
            assert ops.counts.syncs == 0
