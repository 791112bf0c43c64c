"""The stream, event and copy verbs shared by every torch.cuda-shaped backend.

:class:`TorchLikeBackend` implements the stream verbs once on a
:class:`~kvactors.devices._vendor.VendorModule`: ``bind_thread`` sets device and stream inside
the lane thread (both thread-local); handle 0 is ``default_stream(index)``, a nonzero handle
is borrowed with ``ExternalStream``; ``launch`` runs under ``stream(s)``; ``copy_`` blocks for
strided or converting D2H when ``blocking_strided_d2h``. Vendor ``RuntimeError``s become
:class:`~kvactors.errors.DeviceOpError`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Literal, cast, final

import msgspec

from kvactors.devices._vendor import VendorEvent, as_vendor_module, device_errors, int_attr
from kvactors.devices.base import Backend
from kvactors.errors import (
    DeviceOpError,
    InvalidPointerError,
    InvalidSettingError,
    KvactorsError,
    UnsupportedOperationError,
    translate,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvactors.devices._vendor import VendorModule, VendorStream
    from kvactors.devices.base import Marker, StreamLike

__all__ = ("EventMarker", "TorchLikeBackend", "TransferMode")

TransferMode = Literal["engine_driven", "lmcache_driven"]
"""The transfer modes a backend can serve."""


@final
class EventMarker(msgspec.Struct, frozen=True):
    """A completion marker backed by a vendor event; vendor errors become DeviceOpError.
    (A Struct: made on every launch's path, its constructor is C.)"""

    event: VendorEvent
    device: str

    def query(self) -> bool:
        """Whether the marked work completed (never blocks)."""
        with device_errors(self.device, "event query"):
            return bool(self.event.query())

    def synchronize(self) -> None:
        """Block until the marked work completed."""
        with device_errors(self.device, "event synchronize"):
            self.event.synchronize()


class TorchLikeBackend(Backend):
    """Backend verbs over a torch.cuda-shaped vendor module; subclasses add the device edge."""

    handle_attr: str = ""
    """Name of the native stream handle attribute (``mlu_stream`` ...)."""

    def __init__(self, *, blocking_strided_d2h: bool = True) -> None:
        self.blocking_strided_d2h = blocking_strided_d2h
        self._lock = threading.Lock()
        self._checked: set[int] = set()  # device indices _check_index accepted
        self._module: VendorModule | None = None

    # ---- module access --------------------------------------------------------------

    def _load_module(self) -> object:
        """Import and return the vendor module (``torch.mlu`` ...); may raise anything."""
        raise NotImplementedError

    @property
    def module(self) -> VendorModule:
        """The vendor module; raises BackendUnavailableError when the probe fails."""
        mod = self._module
        if mod is None:
            self.require()
            with self._lock:
                if self._module is None:
                    self._module = as_vendor_module(self._load_module())
                mod = self._module
        return mod

    def _name(self, index: int) -> str:
        return f"{self.kind}:{index}"

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidPointerError(f"device index must be an int, got {index!r}", field="device")
        count = self.module.device_count()
        if not 0 <= index < count:
            raise InvalidPointerError(
                f"{self.kind} device index {index} out of range ({count} present)", field="device"
            )
        return index

    def device(self, index: int) -> torch.device:
        """The device of ``index``, as the vendor reports it (its default stream's device).

        Asking the vendor avoids parsing ``"mlu:0"`` with ``torch.device``, which only works
        once the vendor registered its device name with torch.
        """
        self._check_index(index)
        with device_errors(self._name(index), "device"):
            return cast("torch.device", self.module.default_stream(index).device)

    # ---- streams --------------------------------------------------------------------

    def _stream(self, stream: StreamLike) -> VendorStream:
        return cast("VendorStream", stream)

    def bind_thread(self, index: int, stream: StreamLike) -> None:
        """Make device ``index`` and ``stream`` current for the calling lane thread."""
        self._check_index(index)
        with device_errors(self._name(index), "bind_thread"):
            self.module.set_device(index)
            self.module.set_stream(stream)

    def new_stream(self, index: int) -> StreamLike:
        """A new stream owned by kvactors."""
        self._check_index(index)
        with device_errors(self._name(index), "new_stream"):
            return self.module.Stream(device=index)

    def stream_from_handle(self, handle: int, index: int) -> StreamLike:
        """Handle 0: ``default_stream(index)``; nonzero: borrow the caller's stream."""
        self._check_index(index)
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise InvalidPointerError(
                f"stream handle must be an int >= 0, got {handle!r}", field="stream"
            )
        self._check_handle(handle)
        with device_errors(self._name(index), "stream_from_handle"):
            if handle == 0:
                return self.module.default_stream(index)
            return self.module.ExternalStream(handle, device=index)

    def _check_handle(self, handle: int) -> None:
        """Reject handles this vendor cannot borrow (subclass hook)."""

    def stream_handle(self, stream: StreamLike) -> int:
        """The native handle of ``stream``."""
        return int_attr(stream, self.handle_attr)

    def current_stream_handle(self, index: int) -> int:
        """The calling thread's current stream handle on ``index``."""
        # On every engine call's path: the index checked once (the device count is fixed in
        # a process), the translation of device_errors in line.
        if type(index) is not int or index not in self._checked:
            self._checked.add(self._check_index(index))
        try:
            stream = (self._module or self.module).current_stream(index)
        except KvactorsError:
            raise
        except RuntimeError as err:
            name = self._name(index)
            raise translate(
                err, lambda m: DeviceOpError(m, device=name, op="current_stream")
            ) from err
        handle = getattr(stream, self.handle_attr)
        return handle if type(handle) is int else int_attr(stream, self.handle_attr)

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        """Run ``fn`` with ``stream`` current, so its device work is ordered on it."""
        with (self._module or self.module).stream(stream):
            fn()

    def synchronize(self, stream: StreamLike) -> None:
        """Block until all work enqueued on ``stream`` has completed."""
        s = self._stream(stream)
        with device_errors(self._name(s.device_index), "synchronize"):
            s.synchronize()

    def record_marker(self, stream: StreamLike) -> Marker:
        """Record an event on ``stream``."""
        # On every transfer's path: the translation of device_errors, written in line.
        s: VendorStream = stream  # type: ignore[assignment]
        try:
            ev = (self._module or self.module).Event()
            ev.record(s)
        except KvactorsError:
            raise
        except RuntimeError as err:
            name = self._name(s.device_index)
            raise translate(
                err, lambda m: DeviceOpError(m, device=name, op="record_marker")
            ) from err
        return EventMarker(ev, f"{self.kind}:{s.device_index}")

    # ---- copies ---------------------------------------------------------------------

    def must_block(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Blocking strided D2H (rule 6): a device-to-host copy that converts or lands in a
        non-contiguous or differently strided host view blocks, when the backend asks."""
        if not self.blocking_strided_d2h:
            return False
        if dst.device.type != "cpu" or src.device.type != self.kind:
            return False
        return dst.dtype != src.dtype or not dst.is_contiguous() or dst.stride() != src.stride()

    # ---- shared refusals -----------------------------------------------------------

    def _unsupported(self, what: str) -> UnsupportedOperationError:
        return UnsupportedOperationError(what, backend=self.kind)

    def transfer_mode(self, requested: str = "auto") -> TransferMode:
        """The multiprocess transfer mode: ``auto`` is always engine-driven.

        Raises:
            ValueError: an unknown mode.
            UnsupportedOperationError: ``lmcache_driven`` without the capability.
        """
        if requested in ("auto", "engine_driven"):
            return "engine_driven"
        if requested == "lmcache_driven":
            reason = self.lmcache_driven_unavailable()
            if reason:
                raise self._unsupported(f"LMCache-driven transfer mode is not available: {reason}")
            return "lmcache_driven"
        raise InvalidSettingError(f"unknown transfer mode {requested!r}", setting="transfer_mode")

    def lmcache_driven_unavailable(self) -> str:
        """Why LMCache-driven (IPC handle) mode is unavailable; empty when it is available."""
        return "not supported on this backend"
