"""Public fakes for testing kvactors (and code built on it) without vendor hardware.

:func:`fake_vendor` installs an asynchronous fake of ``torch_mlu`` (``torch.mlu``) or
``torch_musa`` (``torch.musa``): a worker thread per stream, thread-local current device and
stream, events (also interprocess), ``ExternalStream(0)`` as a pool stream, device-memory IPC,
host pinning, sticky injected errors, torch_mlu's async strided D2H bug, and timing knobs
(``lazy``: device work runs only once something waits for it; ``delay``/``jitter``). Device
tensors (:class:`FakeDeviceTensor`) live in CPU memory and their work runs later on the
stream's thread, so a missing synchronize or wait reads stale bytes. Queued work runs under
the autograd state (inference mode, grad mode) of the thread that queued it. The fake memory
model keeps the allocator statistics (``memory_allocated``, ``max_memory_allocated``,
``reset_peak_memory_stats``, ``memory_reserved``, ``memory_stats``...), every torch factory
with a ``device`` argument accepts a fake device, and the seeding calls (``manual_seed``,
``manual_seed_all``, ``seed``, ``initial_seed``, RNG state) drive its random factories. With
the ``cross_process`` knob, exported memory and events open in a spawned child that has the
fake installed. ``docs/testing.md`` lists what is modelled and what is not.

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

:class:`ManualBackend` is the deterministic fake: a CPU-backed backend whose streams run only
when the test calls ``release()``, which counts work the runtime dropped before it ran
(``use_after_free``) and IPC owners closed under queued work. Use it to put a race exactly
where a test wants it::

    manual = ManualBackend()
    with Runtime(manual) as rt:
        rt.transfer(request, paged, chunks, complete=False)  # enqueued: nothing ran yet
        manual.release()                                     # now the queued copies run
        rt.fence(request.block_ids)

(``docs/testing.md`` walks through it.)

Fixtures ``fake_mlu`` and ``fake_musa``, and ``--kvactors-fake-vendor=mlu|musa`` (a fake for
a whole pytest session, e.g. to run a vendor's own device suite):
:mod:`kvactors.testing.pytest_plugin`.
:func:`check_backend` (loaded on first access) is the conformance suite behind
``kvactors selftest``: ``check_backend("musa").ok``.
"""

from __future__ import annotations

from typing import Any

from kvactors.testing._counters import OpCounter, OpCounts
from kvactors.testing._device import FakeDevice, FakeDeviceError
from kvactors.testing._install import fake_vendor
from kvactors.testing._ipc import FakeMUSAIPCTensor, MUSAIPCTensorHandle
from kvactors.testing._streams import FakeEvent, FakeStream
from kvactors.testing._tensor import FakeDeviceTensor
from kvactors.testing.manual import ManualBackend
from kvactors.testing.vendor import FakeKnobs, FakeVendor

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
    "ManualBackend",
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
