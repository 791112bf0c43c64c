"""Fake vendor events, including interprocess events (in-process registry).

Theory of operation. An event is created lazily on its first ``record`` or ``ipc_handle``
(binding it to the calling thread's current device, as the real ones do). ``record``
enqueues a :class:`~kvactors.testing._worker.Marker` on a stream and re-recording replaces
it: ``query``/``synchronize``/``wait`` always refer to the latest record. ``wait`` enqueues
a barrier on the waiting stream. An event never recorded is complete, and waiting on it is
a no-op, as in CUDA.

Interprocess events export a 64-byte handle keyed into the vendor's registry; importers
share the exporter's state. The exporter must stay alive: once it is collected, importer
waits raise (the real driver would read freed memory).
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, ClassVar

from kvactors.testing._device import FakeDeviceError

if TYPE_CHECKING:
    import torch

    from kvactors.testing._device import FakeDevice
    from kvactors.testing._streams import FakeStream
    from kvactors.testing._worker import Marker
    from kvactors.testing.vendor import FakeVendor

__all__ = ("IPC_EVENT_HANDLE_BYTES", "FakeEvent")

IPC_EVENT_HANDLE_BYTES = 64


class _EventState:
    __slots__ = ("__weakref__", "device_index", "exporter", "handle", "marker")

    def __init__(self) -> None:
        self.device_index: int | None = None
        self.marker: Marker | None = None
        self.handle = 0
        self.exporter: weakref.ref[FakeEvent] | None = None


class FakeEvent:
    """``Event(enable_timing=False, blocking=False, interprocess=False)``."""

    _vendor: ClassVar[FakeVendor]

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess and enable_timing:
            raise ValueError("interprocess events must have timing disabled")
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._state = _EventState()
        self._ipc: bytes | None = None

    def _create(self, index: int) -> None:
        if self._state.device_index is None:
            self._state.device_index = index
            self._state.handle = self._vendor.next_event_handle()

    @property
    def handle(self) -> int:
        """The native handle (also as e.g. ``musa_event``); 0 until created."""
        return self._state.handle

    @property
    def device(self) -> torch.device | FakeDevice | None:
        """The event's device; None until created."""
        idx = self._state.device_index
        return None if idx is None else self._vendor.make_device(idx)

    def _check_exporter(self) -> None:
        ref = self._state.exporter
        if ref is not None and ref() is None:
            raise FakeDeviceError("the exporter of this IPC event was released")

    def record(self, stream: FakeStream | None = None) -> None:
        """Record on ``stream`` (default: the current stream of the current device)."""
        s = stream if stream is not None else self._vendor.current_stream()
        self._create(s.device_index)
        if self._state.device_index != s.device_index:
            raise FakeDeviceError("event recorded on a stream of another device")
        self._check_exporter()
        self._state.marker = s.marker()

    def wait(self, stream: FakeStream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for the latest record."""
        s = stream if stream is not None else self._vendor.current_stream()
        self._check_exporter()
        marker = self._state.marker
        if marker is not None:
            s.worker.submit_barrier(marker)

    def query(self) -> bool:
        """Whether the latest record completed (never blocks)."""
        marker = self._state.marker
        return marker is None or marker.done.is_set()

    def synchronize(self) -> None:
        """Block until the latest record completed; raise the stream's error it carries."""
        self._check_exporter()
        self._vendor.tally.add("syncs")
        marker = self._state.marker
        if marker is None:
            return
        marker.done.wait()
        if marker.error is not None:
            raise FakeDeviceError(f"event observed a stream error: {marker.error}")

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds between two completed timing events."""
        if not (self.enable_timing and end_event.enable_timing):
            raise FakeDeviceError("elapsed_time needs events created with enable_timing=True")
        a, b = self._state.marker, end_event._state.marker
        if a is None or b is None or not (a.done.is_set() and b.done.is_set()):
            raise FakeDeviceError("both events must be recorded and complete")
        return (b.time - a.time) * 1000.0

    def ipc_handle(self) -> bytes:
        """A 64-byte handle other "processes" (here: importers) can open."""
        if not self.interprocess:
            raise FakeDeviceError("ipc_handle() needs an event created with interprocess=True")
        self._create(self._vendor.current_device())
        if self._ipc is None:
            self._ipc = os.urandom(IPC_EVENT_HANDLE_BYTES)
            self._vendor.ipc_events[self._ipc] = self._state
            self._state.exporter = weakref.ref(self)
        return self._ipc

    @classmethod
    def from_ipc_handle(cls, device: object, handle: bytes) -> FakeEvent:
        """Open an exported event; ``device`` must be of this vendor's kind."""
        v = cls._vendor
        index = v.device_index(device)
        if not isinstance(handle, bytes) or len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise FakeDeviceError(f"IPC event handle must be {IPC_EVENT_HANDLE_BYTES} bytes")
        state = v.ipc_events.get(handle)
        if state is None:
            raise FakeDeviceError("unknown IPC event handle")
        if state.device_index != index:
            raise FakeDeviceError("IPC event opened on the wrong device")
        ev = cls(interprocess=True)
        ev._state = state
        return ev

    def __repr__(self) -> str:
        return f"<fake {self._vendor.kind} Event handle={self._state.handle:#x}>"
