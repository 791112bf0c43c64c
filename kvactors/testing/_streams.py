"""Fake vendor streams: ``Stream``, ``ExternalStream`` and ``StreamContext``.

Theory of operation. A :class:`FakeStream` is a handle (an int, like ``cnrtQueue_t`` or
``musaStream_t``) plus a :class:`~kvactors.testing._worker.StreamWorker`. The vendor object
keeps a registry from handles to streams so ``ExternalStream(handle)`` finds the caller's
stream again; ``ExternalStream(0)`` returns a *pool* stream, exactly as the real C
constructors do when every keyword is zero (device-apis.md section 2), so code that maps
handle 0 through ``ExternalStream`` synchronizes the wrong stream here too. The vendor
builds one subclass per fake with the vendor's handle attribute (``mlu_stream`` or
``musa_stream``), so code reading the wrong vendor's attribute fails.

There is no implicit ordering between the default stream and side streams (stricter than
the CUDA legacy stream): a missing ``wait_stream`` shows up as stale bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from kvactors.testing._worker import Marker

if TYPE_CHECKING:
    from types import TracebackType

    import torch

    from kvactors.testing._device import FakeDevice
    from kvactors.testing._events import FakeEvent
    from kvactors.testing._worker import StreamWorker
    from kvactors.testing.vendor import FakeVendor

__all__ = ("FakeExternalStream", "FakeStream", "FakeStreamContext")


class FakeStream:
    """An asynchronous fake stream: work runs in FIFO order on its own thread."""

    _vendor: ClassVar[FakeVendor]

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

    def enqueue(self, fn: Any) -> None:
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
            other._handle, other._index, other._vendor,
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

    _vendor: ClassVar[FakeVendor]

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
