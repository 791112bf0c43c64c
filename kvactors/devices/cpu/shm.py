"""CPU shared-memory IPC: named POSIX segments described by wire-safe handles.

The exporter allocates in a named segment (:func:`alloc_shared`) and sends only its name and
tensor metadata in an :class:`~kvactors.devices.base.IPCHandle`; the receiver attaches and
views it through the buffer protocol, so closing with a live view raises instead of leaving a
dangling pointer. Only the exporter unlinks (receivers stay out of the resource tracker).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import threading
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import torch

from kvactors.core.pointers import check_view_request
from kvactors.devices.base import IPCHandle
from kvactors.errors import IPCError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = (
    "SEGMENT_PREFIX",
    "SharedTensor",
    "ShmOwner",
    "alloc_shared",
    "export_shared",
    "open_shared",
)

_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")

SEGMENT_PREFIX = "kvactors_"
"""Prefix of the shared-memory segments kvactors creates (``/dev/shm/kvactors_<pid>_<hex>``)."""
_registry_lock = threading.Lock()
_exported: dict[int, SharedTensor] = {}


def _pinned_view(buf: mmap.mmap | memoryview, size: int) -> torch.Tensor:
    # A ctypes array made with from_buffer holds a buffer export on the mapping for as long
    # as it lives, and the tensor keeps the array alive: so the mapping cannot be unmapped
    # (``close`` raises BufferError) while any view of it exists. torch.frombuffer on the
    # memoryview alone would not hold the export and could leave a dangling view.
    raw = (ctypes.c_uint8 * size).from_buffer(buf)
    return torch.frombuffer(raw, dtype=torch.uint8)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise IPCError(f"unknown dtype {name!r} in IPC handle")
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class SharedTensor:
    """An exporter-side tensor in a named shared-memory segment; ``close`` unlinks it."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        numel = 1
        for n in shape:
            numel *= n
        used = numel * torch.empty((), dtype=dtype).element_size()
        # A kvactors prefix (with the pid) names the segment's owner in /dev/shm for operators
        # and leak checks; the random part keeps names unique.
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(used, 1))
        assert self._shm.buf is not None
        flat = _pinned_view(self._shm.buf, self._shm.size)
        self.tensor: torch.Tensor | None = flat[:used].view(dtype).view(*shape)
        self.name = self._shm.name
        with _registry_lock:
            _exported[self._shm_base()] = self

    def _shm_base(self) -> int:
        assert self.tensor is not None
        return self.tensor.untyped_storage().data_ptr()

    def close(self) -> None:
        """Drop the exporter's view, unmap and unlink the segment (idempotent)."""
        if self.tensor is None:
            return
        with _registry_lock:
            _exported.pop(self._shm_base(), None)
        self.tensor = None
        try:
            self._shm.close()
        finally:
            self._shm.unlink()


def alloc_shared(shape: Sequence[int], dtype: torch.dtype) -> SharedTensor:
    """Allocate a zero-filled CPU tensor in a fresh named shared-memory segment."""
    return SharedTensor(shape, dtype)


def export_shared(t: torch.Tensor) -> IPCHandle:
    """Describe ``t`` (a view into a segment from :func:`alloc_shared`) for another process."""
    if t.device.type != "cpu":
        raise IPCError(f"cannot export a {t.device} tensor through CPU shared memory")
    base = t.untyped_storage().data_ptr()
    with _registry_lock:
        owner = _exported.get(base)
    if owner is None or owner.tensor is None:
        raise IPCError(
            "tensor is not in kvactors shared memory; allocate it with alloc_shared() to export"
        )
    return IPCHandle(
        backend="cpu",
        name=owner.name,
        dtype=_dtype_name(t.dtype),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        storage_offset=int(t.storage_offset()),
        nbytes=owner._shm.size,
    )


class ShmOwner:
    """Receiver-side owner of an attached segment and the view built on it."""

    def __init__(self, handle: IPCHandle) -> None:
        if handle.backend != "cpu":
            raise IPCError(f"not a CPU handle: backend {handle.backend!r}", handle=handle.name)
        if not _SEGMENT_NAME.fullmatch(handle.name):
            raise IPCError(f"invalid segment name {handle.name!r}", handle=handle.name)
        dtype = _dtype(handle.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Attach with a plain mmap rather than SharedMemory: Python < 3.13 registers attached
        # segments with the resource tracker, which then unlinks (or double-unregisters) the
        # exporter's segment. Only the exporter owns the segment's name.
        try:
            fd = os.open(f"/dev/shm/{handle.name}", os.O_RDWR)
        except FileNotFoundError as exc:
            raise IPCError(f"no shared-memory segment {handle.name!r}", handle=handle.name) from exc
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        if mm is None:
            raise IPCError(f"segment {handle.name!r} is empty", handle=handle.name)
        self._mm: mmap.mmap | None = mm
        try:
            req = check_view_request(
                size,  # any positive placeholder: the view is built from the buffer below
                handle.shape,
                itemsize,
                stride=handle.stride,
                storage_offset=handle.storage_offset,
                available_nbytes=size,
            )
            flat = _pinned_view(mm, size)
            typed = flat[: size - size % itemsize].view(dtype)
            self._tensor: torch.Tensor | None = typed.as_strided(
                req.shape, req.stride, req.storage_offset
            )
        except BaseException:
            self._mm = None
            mm.close()
            raise
        self.name = handle.name

    @property
    def tensor(self) -> torch.Tensor:
        """The view onto the segment (valid until ``close``)."""
        if self._tensor is None:
            raise IPCError("owner is closed", handle=self.name)
        return self._tensor

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run."""
        return self._mm is None

    def close(self) -> None:
        """Drop the view and unmap; raises :class:`IPCError` if a view is still alive elsewhere."""
        mm = self._mm
        if mm is None:
            return
        self._tensor = None
        try:
            mm.close()
        except BufferError as exc:
            raise IPCError(
                f"segment {self.name!r} still has live views; drop them before closing",
                handle=self.name,
            ) from exc
        self._mm = None


def open_shared(handle: IPCHandle) -> ShmOwner:
    """Attach to an exported segment and build the described view."""
    return ShmOwner(handle)
