"""Interprocess state of the fakes (knob ``cross_process``): event flags in shared memory.

An exported event is a small file in shared memory holding three counters: how many records
the exporter made, how many of them completed, and whether the exporter released the event.
An importer in another process (a spawned child with the fake installed) reads them: a wait
on the imported event becomes a barrier that polls the file on the waiting stream's worker
thread, so the waiting stream runs on only after the exporter's stream reached the record.
Memory crosses processes as torch's own shared CPU memory (``kvactors.testing._ipc``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import time
from typing import Final

from kvactors.testing._device import FakeDeviceError
from kvactors.testing._worker import Marker

__all__ = ("EVENT_PREFIX", "RemoteMarker", "SharedEventFlags")

EVENT_PREFIX: Final = b"KVFE"
_LAYOUT = struct.Struct("<QQQ")  # records, completed, released
_POLL_S = 0.0005  # how often a waiter on another process's event looks again


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedEventFlags:
    """The counters of one exported event, mapped from a shared-memory file."""

    __slots__ = ("_map", "owner", "path")

    def __init__(self, path: str, mapped: mmap.mmap, owner: bool) -> None:
        self.path = path
        self._map = mapped
        self.owner = owner

    @classmethod
    def create(cls, limit: int) -> SharedEventFlags:
        """A new flags file (the exporter's); its path fits in ``limit`` bytes."""
        path = os.path.join(_directory(), f"kvfake-ev-{os.getpid()}-{os.urandom(6).hex()}")
        if len(path.encode()) > limit:
            raise FakeDeviceError(f"IPC event path too long for a handle: {path}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            mapped = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        return cls(path, mapped, owner=True)

    @classmethod
    def open(cls, path: str) -> SharedEventFlags:
        """Map an exporter's flags file; FakeDeviceError if it is gone (released)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise FakeDeviceError("unknown IPC event handle") from exc
        try:
            mapped = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        return cls(path, mapped, owner=False)

    def _read(self) -> tuple[int, int, int]:
        records, completed, released = _LAYOUT.unpack_from(self._map, 0)
        return int(records), int(completed), int(released)

    def record(self) -> int:
        """Count a new record (exporter); its sequence number."""
        records, completed, released = self._read()
        _LAYOUT.pack_into(self._map, 0, records + 1, completed, released)
        return records + 1

    def complete(self, seq: int) -> None:
        """Record ``seq`` completed (exporter's stream worker; completions only grow)."""
        records, completed, released = self._read()
        if seq > completed:
            _LAYOUT.pack_into(self._map, 0, records, seq, released)

    def latest(self) -> int:
        """The sequence number of the latest record."""
        return self._read()[0]

    def completed(self, seq: int) -> bool:
        """Whether record ``seq`` completed."""
        return self._read()[1] >= seq

    def released(self) -> bool:
        """Whether the exporter released the event."""
        return self._read()[2] != 0

    def release(self) -> None:
        """The exporter let go of the event: importers' waits fail, new opens fail."""
        try:
            records, completed, _ = self._read()
            _LAYOUT.pack_into(self._map, 0, records, completed, 1)
        except ValueError:  # already unmapped
            return
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class RemoteMarker(Marker):
    """A point on another process's stream: record ``seq`` of an exported event."""

    __slots__ = ("_flags", "_seq")

    def __init__(self, flags: SharedEventFlags, seq: int) -> None:
        super().__init__()
        self._flags = flags
        self._seq = seq

    def wait(self, timeout: float | None = None) -> bool:
        """Poll the exporter's flags until the record completed; False on timeout. An
        exporter that released the event completes the marker with an error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done.is_set():
            if self._flags.completed(self._seq):
                self.complete(None)
            elif self._flags.released():
                self.complete(FakeDeviceError("the exporter of this IPC event was released"))
            elif deadline is not None and time.monotonic() >= deadline:
                return False
            else:
                time.sleep(_POLL_S)
        return True
