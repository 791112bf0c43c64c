"""Public fakes for testing kvactors (and code built on it) without vendor hardware.

:func:`fake_vendor` installs an asynchronous fake of ``torch_mlu`` (``torch.mlu``) or
``torch_musa`` (``torch.musa``): a worker thread per stream, thread-local current device and
stream, events (also interprocess), ``ExternalStream(0)`` as a pool stream, device-memory IPC,
host pinning, sticky injected errors, torch_mlu's async strided D2H bug, and timing knobs
(``lazy``: device work runs only once something waits for it; ``delay``/``jitter``). Device
tensors (:class:`FakeDeviceTensor`) live in CPU memory and their work runs later on the
stream's thread, so a missing synchronize or wait reads stale bytes.

The first fake installed in a process claims torch's private device name
(``KVACTORS_FAKE_VENDOR=mlu|musa`` pins which kind may), so ``torch.device("mlu:0")``,
``tensor.to("mlu:0")`` and ``t.device.type`` behave as on a card; a fake of the other kind
falls back to :class:`FakeDevice`. Every fake counts its device operations
(``fake.counters()``, ``with fake.counting() as ops``). Example::

    with fake_vendor("musa", lazy=True) as fake:
        import torch_musa
        dev = fake.to_device(torch.arange(8.0))
        host = torch.empty(8).pin_memory()
        host.copy_(dev, non_blocking=True)     # enqueued: host is still stale here
        torch_musa.current_stream().synchronize()
        assert torch.equal(host, torch.arange(8.0))

Fixtures ``fake_mlu`` and ``fake_musa``: :mod:`kvactors.testing.pytest_plugin`.
:func:`check_backend` (loaded on first access) is the conformance suite behind
``kvactors selftest``: ``check_backend("musa").ok``.
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
    "BackendReport": "kvactors.testing.conformance.check",
    "CheckResult": "kvactors.testing.conformance.check",
    "check_backend": "kvactors.testing.conformance.check",
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
