"""Fake vendor streams and events: ``Stream``, ``ExternalStream``, ``StreamContext``, ``Event``.

A :class:`FakeStream` is a handle plus a :class:`~kvactors.testing._worker.StreamWorker`;
``ExternalStream(handle)`` finds a registered stream and ``ExternalStream(0)`` returns a pool
stream, as the real constructors do. No implicit order between default and side streams.
An event records a marker on a stream (latest record wins; never recorded = complete);
``wait`` enqueues a barrier. Interprocess events share the exporter's state and fail once the
exporter is gone.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvactors.testing._device import FakeDeviceError
from kvactors.testing._owner import Owner
from kvactors.testing._worker import Marker
from kvactors.testing._xproc import EVENT_PREFIX, RemoteMarker, SharedEventFlags

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    import torch

    from kvactors.testing._device import FakeDevice
    from kvactors.testing._worker import StreamWorker

__all__ = (
    "IPC_EVENT_HANDLE_BYTES",
    "FakeEvent",
    "FakeExternalStream",
    "FakeStream",
    "FakeStreamContext",
    "StreamOwner",
)


class StreamOwner(Owner, Protocol):
    """The vendor as its streams and events see it (``FakeVendor`` satisfies it)."""

    @property
    def ipc_events(self) -> dict[bytes, _EventState]:
        """Exported interprocess events by handle."""

    @property
    def Event(self) -> type[FakeEvent]:
        """The vendor's ``Event`` class."""

    def current_stream(self, device: object = None) -> FakeStream:
        """The calling thread's current stream on ``device``."""

    def set_stream(self, stream: FakeStream | None) -> None:
        """Make ``stream`` current (and its device) for the calling thread."""

    def set_device(self, device: object) -> None:
        """Set the calling thread's current device."""

    def next_stream_handle(self) -> int:
        """A fresh nonzero native stream handle."""

    def next_event_handle(self) -> int:
        """A fresh nonzero native event handle."""

    def register_stream(self, stream: FakeStream) -> StreamWorker:
        """Start the worker of a new stream and index it by handle."""

    def pool_stream(self, index: int) -> FakeStream:
        """The next stream of ``index``'s pool."""

    def stream_by_handle(self, handle: int) -> FakeStream:
        """The stream registered under ``handle``."""


class FakeStream:
    """An asynchronous fake stream: work runs in FIFO order on its own thread."""

    _vendor: ClassVar[StreamOwner]

    def __init__(self, device: object = None, priority: int = 0, **kwargs: Any) -> None:
        index = self._vendor.device_index(device)
        self._init(index, priority, self._vendor.next_stream_handle())

    def _init(self, index: int, priority: int, handle: int) -> None:
        self._index = index
        self._priority = priority
        self._handle = handle
        self.worker: StreamWorker = self._vendor.register_stream(self)

    @property
    def handle(self) -> int:
        """The native handle (also exposed under the vendor's name, e.g. ``mlu_stream``)."""
        return self._handle

    @property
    def device_index(self) -> int:
        """The device ordinal."""
        return self._index

    @property
    def device_type(self) -> str:
        """The device kind."""
        return self._vendor.kind

    @property
    def device(self) -> torch.device | FakeDevice:
        """The stream's device."""
        return self._vendor.make_device(self._index)

    @property
    def stream_id(self) -> int:
        """A stable id (the handle)."""
        return self._handle

    @property
    def priority(self) -> int:
        """The priority given at construction."""
        return self._priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest) priority, as the vendors report it."""
        return (0, -1)

    def enqueue(self, fn: Callable[[], object]) -> None:
        """Enqueue device work on this stream (used by the fake's tensor ops)."""
        self.worker.submit(fn)

    def query(self) -> bool:
        """Whether all work enqueued so far has completed."""
        return self.worker.idle()

    def synchronize(self) -> None:
        """Block until all work enqueued before the call ran; raise a sticky error."""
        self._vendor.tally.add("syncs")
        self.worker.synchronize()

    def wait_event(self, event: FakeEvent) -> None:
        """Make later work on this stream wait for ``event``'s latest record."""
        event.wait(self)

    def wait_stream(self, stream: FakeStream) -> None:
        """Make later work wait for the work enqueued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        """Record ``event`` (or a new event) on this stream and return it."""
        ev = event if event is not None else self._vendor.Event()
        ev.record(self)
        return ev

    def marker(self) -> Marker:
        """Enqueue and return a bare marker (fake-only helper)."""
        m = Marker()
        self.worker.submit_marker(m)
        return m

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FakeStream):
            return NotImplemented
        return (self._handle, self._index, self._vendor) == (
            other._handle,
            other._index,
            other._vendor,
        )

    def __hash__(self) -> int:
        return hash((self._handle, self._index))

    def __repr__(self) -> str:
        return f"<fake {self._vendor.kind} Stream device={self._index} handle={self._handle:#x}>"


class FakeExternalStream(FakeStream):
    """``ExternalStream(ptr, device=None)``: the registered stream for ``ptr``.

    ``ptr == 0`` returns a pool stream, as the real constructors do.
    """

    def __new__(cls, stream_ptr: int, device: object = None, **kwargs: Any) -> FakeStream:  # type: ignore[misc]
        index = cls._vendor.device_index(device)
        if stream_ptr == 0:
            return cls._vendor.pool_stream(index)
        return cls._vendor.stream_by_handle(int(stream_ptr))

    def __init__(self, stream_ptr: int, device: object = None, **kwargs: Any) -> None:
        """Never reached: ``__new__`` returns an existing stream."""


class FakeStreamContext:
    """``stream(s)``: make ``s`` current for the calling thread; None is a no-op."""

    _vendor: ClassVar[StreamOwner]

    def __init__(self, stream: FakeStream | None) -> None:
        self.stream = stream
        self._saved: tuple[int, FakeStream] | None = None
        self._saved_device = 0

    def __enter__(self) -> FakeStream | None:
        s = self.stream
        if s is None:
            return None
        v = self._vendor
        self._saved_device = v.current_device()
        self._saved = (s.device_index, v.current_stream(s.device_index))
        v.set_stream(s)
        return s

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None:
            self._vendor.set_stream(self._saved[1])
            self._vendor.set_device(self._saved_device)
            self._saved = None


IPC_EVENT_HANDLE_BYTES = 64


class _EventState:
    __slots__ = ("__weakref__", "device_index", "exporter", "handle", "marker", "remote", "shared")

    def __init__(self) -> None:
        self.device_index: int | None = None
        self.marker: Marker | None = None
        self.handle = 0
        self.exporter: weakref.ref[FakeEvent] | None = None
        self.shared: SharedEventFlags | None = None  # exported across processes (exporter)
        self.remote: SharedEventFlags | None = None  # opened from another process

    def publish(self, marker: Marker) -> None:
        """Let other processes see when ``marker`` (a record of this event) completes."""
        flags = self.shared
        if flags is not None:
            seq = flags.record()
            marker.when_done(lambda: flags.complete(seq))


class FakeEvent:
    """``Event(enable_timing=False, blocking=False, interprocess=False)``."""

    _vendor: ClassVar[StreamOwner]

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
        remote = self._state.remote
        if (ref is not None and ref() is None) or (remote is not None and remote.released()):
            raise FakeDeviceError("the exporter of this IPC event was released")

    def record(self, stream: FakeStream | None = None) -> None:
        """Record on ``stream`` (default: the current stream of the current device)."""
        s = stream if stream is not None else self._vendor.current_stream()
        self._create(s.device_index)
        if self._state.device_index != s.device_index:
            raise FakeDeviceError("event recorded on a stream of another device")
        self._check_exporter()
        if self._state.remote is not None:
            raise FakeDeviceError("record() on an event opened from another process")
        marker = s.marker()
        self._state.marker = marker
        self._state.publish(marker)

    def _latest(self) -> Marker | None:
        remote = self._state.remote
        if remote is not None:
            seq = remote.latest()
            return RemoteMarker(remote, seq) if seq else None
        return self._state.marker

    def wait(self, stream: FakeStream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for the latest record."""
        s = stream if stream is not None else self._vendor.current_stream()
        self._check_exporter()
        marker = self._latest()
        if marker is not None:
            s.worker.submit_barrier(marker)

    def query(self) -> bool:
        """Whether the latest record completed (never blocks)."""
        self._check_exporter()
        remote = self._state.remote
        if remote is not None:
            return remote.completed(remote.latest())
        marker = self._state.marker
        return marker is None or marker.done.is_set()

    def synchronize(self) -> None:
        """Block until the latest record completed; raise the stream's error it carries."""
        self._check_exporter()
        self._vendor.tally.add("syncs")
        marker = self._latest()
        if marker is None:
            return
        marker.wait()
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
            state = self._state
            if self._vendor.knobs.cross_process and state.remote is None:
                flags = SharedEventFlags.create(IPC_EVENT_HANDLE_BYTES - len(EVENT_PREFIX))
                path = flags.path.encode()
                self._ipc = (
                    EVENT_PREFIX
                    + path
                    + b"\0" * (IPC_EVENT_HANDLE_BYTES - len(EVENT_PREFIX) - len(path))
                )
                state.shared = flags
                if state.marker is not None:  # recorded before the export
                    state.publish(state.marker)
                weakref.finalize(self, flags.release)
            else:
                self._ipc = os.urandom(IPC_EVENT_HANDLE_BYTES)
            self._vendor.ipc_events[self._ipc] = state
            state.exporter = weakref.ref(self)
        return self._ipc

    @classmethod
    def from_ipc_handle(cls, device: object, handle: bytes) -> FakeEvent:
        """Open an exported event; ``device`` must be of this vendor's kind."""
        v = cls._vendor
        index = v.device_index(device)
        if not isinstance(handle, bytes) or len(handle) != IPC_EVENT_HANDLE_BYTES:
            raise FakeDeviceError(f"IPC event handle must be {IPC_EVENT_HANDLE_BYTES} bytes")
        state = v.ipc_events.get(handle)
        if state is None and handle.startswith(EVENT_PREFIX):  # another process's export
            state = _EventState()
            state.remote = SharedEventFlags.open(handle[len(EVENT_PREFIX) :].rstrip(b"\0").decode())
            state.device_index = index
            state.handle = v.next_event_handle()
            v.ipc_events[handle] = state
        if state is None:
            raise FakeDeviceError("unknown IPC event handle")
        if state.device_index != index:
            raise FakeDeviceError("IPC event opened on the wrong device")
        ev = cls(interprocess=True)
        ev._state = state
        return ev

    def __repr__(self) -> str:
        return f"<fake {self._vendor.kind} Event handle={self._state.handle:#x}>"
