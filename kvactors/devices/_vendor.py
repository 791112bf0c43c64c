"""Typed views of the untyped vendor modules (torch.mlu, torch.musa, torch.cuda).

Theory of operation. The vendor packages ship no type information, and their stream and
event classes are plain Python wrappers over C types. Backends talk to them only through
these small Protocols (the subset of the torch.cuda-shaped API kvactors uses), reached with
one ``cast`` in :func:`as_vendor_module`, so strict typing holds everywhere else and the
surface kvactors depends on is written down in one place.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvactors.errors import DeviceOpError, OperandTypeError, translating

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

__all__ = (
    "VendorEvent",
    "VendorModule",
    "VendorStream",
    "as_vendor_module",
    "device_errors",
    "int_attr",
)


class VendorStream(Protocol):
    """A vendor stream (``torch.mlu.Stream`` and friends)."""

    @property
    def device_index(self) -> int: ...

    @property
    def device(self) -> Any: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


class VendorEvent(Protocol):
    """A vendor event."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class VendorModule(Protocol):
    """The torch.cuda-shaped module surface kvactors uses."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def set_device(self, device: int) -> None: ...

    def current_stream(self, device: int | None = None) -> VendorStream: ...

    def default_stream(self, device: int | None = None) -> VendorStream: ...

    def set_stream(self, stream: Any) -> None: ...

    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def synchronize(self, device: int | None = None) -> None: ...

    def Stream(self, device: int | None = None, priority: int = 0) -> VendorStream: ...

    def ExternalStream(self, stream_ptr: int, device: int | None = None) -> VendorStream: ...

    def Event(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> VendorEvent: ...


def as_vendor_module(module: object) -> VendorModule:
    """Type a vendor module object as :class:`VendorModule` (no runtime check)."""
    return cast("VendorModule", module)


def int_attr(obj: object, name: str) -> int:
    """``obj.<name>`` as an int (native handles); OperandTypeError (a TypeError) if not."""
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OperandTypeError(
            f"{type(obj).__name__}.{name} is {type(value).__name__}, not an int", field=name
        )
    return value


@contextlib.contextmanager
def device_errors(device: str, op: str) -> Iterator[None]:
    """Translate vendor ``RuntimeError``s into :class:`DeviceOpError` (kvactors errors pass)."""
    with translating(lambda m: DeviceOpError(m, device=device, op=op), (RuntimeError,)):
        yield
