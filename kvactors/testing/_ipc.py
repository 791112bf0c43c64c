"""Fake device-memory IPC: ``torch.musa.ipc`` and the MLU storage-sharing shims.

Exporting shares a whole storage (the 8-item ``shared_storage_info`` of
``UntypedStorage._share_musa_()``); the handle keys a registry holding only a weak reference,
so the producer must keep its tensor alive. The export records an interprocess event that the
opener's current stream waits on. Receivers get an owner whose ``tensor`` is a non-owning view
until ``close()``. With the knob ``cross_process`` the export moves the storage into torch's
shared CPU memory (in place: every view follows) and its handle names that memory, so a
spawned child with the fake installed maps the same bytes; without it, a handle names nothing
outside the exporting process.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from kvactors.testing._device import FakeDeviceError
from kvactors.testing._memory import weak_storage
from kvactors.testing._tensor import FakeDeviceTensor, plain, wrap

if TYPE_CHECKING:
    from types import TracebackType

    from kvactors.testing.vendor import FakeVendor

__all__ = (
    "FakeMUSAIPCTensor",
    "MUSAIPCTensorHandle",
    "SharedStorage",
    "new_shared",
    "share_storage",
)

_BYTES_ITEMS = (1, 4, 6)
_SHM_PREFIX = b"kvfake-shm\0"  # a handle naming torch shared memory (knob cross_process)


class SharedStorage:
    """Registry entry for an exported storage."""

    __slots__ = ("device", "event", "nbytes", "ptr", "ref")

    def __init__(self, storage: torch.UntypedStorage, device: int) -> None:
        self.event: object = None  # the exporter keeps its IPC event alive
        self.ptr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.device = device
        self.ref = weak_storage(storage)


def share_storage(vendor: FakeVendor, storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """``_share_<kind>_()``: register a device storage and return the 8-item share tuple."""
    device = vendor.memory.device_of(storage.data_ptr(), storage.nbytes())
    if device is None:
        raise FakeDeviceError(f"storage is not {vendor.kind} device memory")
    if vendor.knobs.cross_process:
        key = _to_shared_memory(vendor, storage, device)
    else:
        key = os.urandom(16)
    entry = SharedStorage(storage, device)
    vendor.ipc_storages[key] = entry
    event_handle = b""
    sync_required = False
    if vendor.knobs.event_ipc:
        ev = vendor.Event(interprocess=True)
        ev.record(vendor.current_stream(device))
        event_handle = ev.ipc_handle()
        entry.event = ev
        sync_required = True
    return (device, key, storage.nbytes(), 0, b"refcounter", 0, event_handle, sync_required)


def _to_shared_memory(vendor: FakeVendor, storage: torch.UntypedStorage, device: int) -> bytes:
    """Move ``storage`` into torch's shared CPU memory (every view follows: torch swaps the
    storage's memory in place) and return a handle naming it for other processes."""
    old = storage.data_ptr()
    if not storage.is_shared():
        vendor.drain(device)  # no queued copy may still run on the old memory
    manager, name, _size = storage._share_filename_cpu_()  # type: ignore[attr-defined]
    if storage.data_ptr() != old:
        vendor.memory.moved(old, storage)
    return _SHM_PREFIX + bytes(manager) + b"\0" + bytes(name)


def _open_shared_memory(
    vendor: FakeVendor, key: bytes, device: int, size: int
) -> torch.UntypedStorage:
    """Map another process's exported storage (it must still hold it)."""
    manager, _, name = key[len(_SHM_PREFIX) :].partition(b"\0")
    try:
        storage = torch.UntypedStorage._new_shared_filename_cpu(  # type: ignore[attr-defined]
            manager, name, size
        )
    except RuntimeError as exc:
        raise FakeDeviceError("unknown or released IPC memory handle") from exc
    vendor.memory.add_device(torch.empty(0, dtype=torch.uint8).set_(storage), device, fresh=False)
    return storage


def new_shared(vendor: FakeVendor, info: tuple[Any, ...]) -> torch.UntypedStorage:
    """``_new_shared_<kind>(*info)``: reopen a shared storage (honours the IPC event)."""
    device, key, size, offset, _refc, _refc_off, event_handle, sync_required = info
    for name, value in (("handle", key), ("ref_counter", _refc), ("event_handle", event_handle)):
        if not isinstance(value, bytes):
            raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    entry = vendor.ipc_storages.get(key)
    remote = entry is None and key.startswith(_SHM_PREFIX)
    if not remote and (entry is None or entry.ref.expired()):
        raise FakeDeviceError("unknown or released IPC memory handle")
    if entry is not None and size + offset > entry.nbytes:
        raise FakeDeviceError("IPC storage size exceeds the exported allocation")
    if remote:
        whole = _open_shared_memory(vendor, key, int(device), size + offset)
    if sync_required and event_handle:
        vendor.Event.from_ipc_handle(device, event_handle).wait(vendor.current_stream(device))
    if remote:
        if offset == 0:
            return whole
        raise FakeDeviceError("a storage opened from another process starts at its export")
    assert entry is not None
    storage = torch._C._construct_storage_from_data_pointer(
        entry.ptr + offset, torch.device("cpu"), size
    )
    return cast("torch.UntypedStorage", storage)


@dataclasses.dataclass(frozen=True)
class MUSAIPCTensorHandle:
    """What ``export_tensor`` returns: shared storage info plus view metadata."""

    shared_storage_info: tuple[Any, ...]
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    device_uuid: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (bytes items base64-encoded, dtype as a string)."""
        info = [
            base64.b64encode(v).decode("ascii") if i in _BYTES_ITEMS else v
            for i, v in enumerate(self.shared_storage_info)
        ]
        return {
            "shared_storage_info": info,
            "dtype": str(self.dtype),
            "size": list(self.size),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
            "requires_grad": self.requires_grad,
            "device_uuid": self.device_uuid,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MUSAIPCTensorHandle:
        """Invert :meth:`to_dict`."""
        info = tuple(
            base64.b64decode(v) if i in _BYTES_ITEMS else v
            for i, v in enumerate(d["shared_storage_info"])
        )
        dtype = getattr(torch, str(d["dtype"]).removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {d['dtype']!r}")
        return cls(
            shared_storage_info=info,
            dtype=dtype,
            size=tuple(d["size"]),
            stride=tuple(d["stride"]),
            storage_offset=int(d["storage_offset"]),
            requires_grad=bool(d["requires_grad"]),
            device_uuid=str(d["device_uuid"]),
        )


class FakeMUSAIPCTensor:
    """The receiver-side owner returned by ``open_tensor``."""

    def __init__(self, vendor: FakeVendor, tensor: FakeDeviceTensor) -> None:
        self._vendor = vendor
        self._tensor: FakeDeviceTensor | None = tensor
        vendor.open_owners.append(self)

    @property
    def tensor(self) -> FakeDeviceTensor:
        """The opened view; raises once closed."""
        if self._tensor is None:
            raise RuntimeError("MUSAIPCTensor is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran."""
        return self._tensor is None

    def close(self) -> None:
        """Drop the mapping (idempotent)."""
        if self._tensor is not None:
            self._tensor = None
            if self in self._vendor.open_owners:
                self._vendor.open_owners.remove(self)

    def __enter__(self) -> FakeMUSAIPCTensor:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def export_tensor(vendor: FakeVendor, t: object) -> MUSAIPCTensorHandle:
    """``torch.musa.ipc.export_tensor``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"export_tensor expects a Tensor, got {type(t).__name__}")
    if not isinstance(t, FakeDeviceTensor) or t.device.type != vendor.kind:
        raise RuntimeError(f"export_tensor expects a {vendor.kind} tensor")
    info = share_storage(vendor, plain(t).untyped_storage())
    props = vendor.get_device_properties(t.device.index)
    return MUSAIPCTensorHandle(
        shared_storage_info=info,
        dtype=t.dtype,
        size=tuple(t.shape),
        stride=tuple(t.stride()),
        storage_offset=int(t.storage_offset()),
        requires_grad=False,
        device_uuid=str(props.uuid) if props.uuid is not None else "",
    )


def open_tensor(vendor: FakeVendor, handle: MUSAIPCTensorHandle) -> FakeMUSAIPCTensor:
    """``torch.musa.ipc.open_tensor``: map the exporter's storage on the matching device."""
    if not isinstance(handle, MUSAIPCTensorHandle):
        raise TypeError("open_tensor expects a MUSAIPCTensorHandle")
    index = int(handle.shared_storage_info[0])
    if handle.device_uuid:
        uuids = [vendor.get_device_properties(i).uuid for i in range(vendor.device_count())]
        if handle.device_uuid not in uuids:
            raise RuntimeError(f"no visible device with uuid {handle.device_uuid}")
        index = uuids.index(handle.device_uuid)
    storage = new_shared(vendor, (index, *handle.shared_storage_info[1:]))
    view = torch.empty(0, dtype=handle.dtype).set_(
        storage, handle.storage_offset, handle.size, handle.stride
    )
    return FakeMUSAIPCTensor(vendor, wrap(view, vendor, index))
