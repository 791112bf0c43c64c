"""Public fakes for testing kvactors (and code built on it) without vendor hardware.

:func:`fake_vendor` installs an asynchronous fake of ``torch_mlu`` (``torch.mlu``) or
``torch_musa`` (``torch.musa``): one worker thread per stream, thread-local current device
and stream, events (also interprocess), ``ExternalStream(0)`` returning a pool stream,
device-memory IPC, host pinning, seeded per-op delay and jitter, sticky injected errors and
a knob reproducing torch_mlu's asynchronous strided device-to-host bug. Device memory is CPU
memory; device tensors are :class:`FakeDeviceTensor` instances whose device work really
runs later, on the stream's thread, so a missing synchronize or wait yields stale bytes.

Vendor code runs as written: the first fake installed in a process claims torch's private
device name (as torch_mlu / torch_musa do on import; ``KVACTORS_FAKE_VENDOR=mlu|musa`` pins
which kind may), so ``torch.device("mlu:0")``, ``tensor.to("mlu:0")``, ``tensor.mlu()``,
``torch.empty(..., device="mlu")`` and ``t.device.type == "mlu"`` behave as on a card. torch
allows one such name per process: a fake of the other kind in the same process falls back to
:class:`FakeDevice` objects (see ``kvactors.testing._device``).

Every fake counts the device operations it performs (kernel launches, host<->device copies,
host synchronisations, device allocations): ``fake.counters()`` is an :class:`OpCounts`
snapshot and ``with fake.counting() as ops: ...`` gives ``ops.counts`` for one call.

Example::

    with fake_vendor("musa", jitter=0.001, seed=3) as fake:
        import torch_musa
        dev = fake.to_device(torch.arange(8.0))
        host = torch.empty(8).pin_memory()
        host.copy_(dev, non_blocking=True)     # enqueued: host is still stale here
        torch_musa.current_stream().synchronize()
        assert torch.equal(host, torch.arange(8.0))

The pytest plugin :mod:`kvactors.testing.pytest_plugin` provides fixtures ``fake_mlu`` and
``fake_musa``. The vendor fakes depend on nothing else in kvactors.

:func:`check_backend` (loaded on first access: it runs the Runtime) is the conformance suite
behind ``kvactors selftest``, for vendors' CI: ``check_backend("musa").ok``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from kvactors.testing._counters import OpCounter, OpCounts
from kvactors.testing._device import FakeDevice, FakeDeviceError
from kvactors.testing._ipc import FakeMUSAIPCTensor, MUSAIPCTensorHandle
from kvactors.testing._streams import FakeEvent, FakeStream
from kvactors.testing._tensor import FakeDeviceTensor
from kvactors.testing.vendor import FakeKnobs, FakeVendor

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = (
    "BackendReport",
    "CheckResult",
    "FakeDevice",
    "FakeDeviceError",
    "FakeDeviceTensor",
    "FakeEvent",
    "FakeKnobs",
    "FakeMUSAIPCTensor",
    "FakeStream",
    "FakeVendor",
    "MUSAIPCTensorHandle",
    "OpCounter",
    "OpCounts",
    "check_backend",
    "fake_vendor",
)

_LAZY = {
    "BackendReport": "kvactors.testing.check",
    "CheckResult": "kvactors.testing.check",
    "check_backend": "kvactors.testing.check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def fake_vendor(kind: str, **knobs: Any) -> Iterator[FakeVendor]:
    """Install a fake ``torch_mlu`` or ``torch_musa`` for the duration of the block.

    Args:
        kind: ``"mlu"`` or ``"musa"``.
        **knobs: fields of :class:`FakeKnobs` (``seed``, ``delay``, ``jitter``, ``lazy``,
            ``devices``, ``available``, ``strided_d2h_bug``, ``pageable_async``,
            ``pool_size``, ``vendor_constructor``, ``ipc``, ``event_ipc``, ``musart``,
            ``uuid``).

    Yields:
        The :class:`FakeVendor` behind the module, for inspection and fault injection.

    Raises:
        RuntimeError: the real (or another fake) module of that kind is already present.
        TypeError: an unknown knob.

    On exit every stream is drained and its thread joined, and ``sys.modules``, ``torch``
    and the patched torch entry points are restored.
    """
    from kvactors.testing._assembly import Installation

    names = {f.name for f in dataclasses.fields(FakeKnobs)}
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise TypeError(f"unknown fake_vendor knobs: {unknown}")
    vendor = FakeVendor(kind, FakeKnobs(**knobs))
    inst = Installation(vendor)
    try:
        inst.install()
        yield vendor
    finally:
        try:
            vendor.close()
        finally:
            inst.uninstall()
