"""Test doubles and process helpers for the fault scenarios.

:class:`FaultyBackend` is a :class:`~kvactors.testing.manual.ManualBackend` whose device can
be told to report an error for chosen launches: the work still runs when released (or at
launch with ``auto=True``), but the completion marker recorded after it reports the error,
exactly as the fake vendors do (``FakeEvent.query`` is True once the point was reached, and
``synchronize`` raises the stream error the marker carries). Child-process bodies for the IPC
scenarios live here too, so ``multiprocessing``'s spawn start method can import them.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import torch

from kvactors.devices.cpu import CpuBackend
from kvactors.testing.manual import ManualBackend

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvactors.devices.base import Marker, StreamLike


class DeviceFault(RuntimeError):
    """The error the double's device reports (a vendor error, untranslated)."""


class _FailingMarker:
    def __init__(self, inner: Marker, message: str) -> None:
        self._inner = inner
        self._message = message

    def query(self) -> bool:
        return self._inner.query()

    def synchronize(self) -> None:
        self._inner.synchronize()
        raise DeviceFault(self._message)


class FaultyBackend(ManualBackend):
    """ManualBackend whose next ``fail_next`` launches complete with a device error."""

    def __init__(self, *, auto: bool = False) -> None:
        super().__init__(auto=auto)
        self.fail_next = 0
        self.failed_launches = 0

    def record_marker(self, stream: StreamLike) -> Marker:
        """Record a marker; a marked launch's marker reports a device error."""
        marker = super().record_marker(stream)
        with self._cond:
            if self.fail_next <= 0:
                return marker
            self.fail_next -= 1
            self.failed_launches += 1
        return _FailingMarker(marker, f"injected device error #{self.failed_launches}")


# ---- process accounting -------------------------------------------------------------------


def shm_mappings() -> int:
    """Lines of /proc/self/maps that map a /dev/shm segment."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(1 for line in f if "/dev/shm/" in line)


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def shm_exists(name: str) -> bool:
    """Whether the named segment still exists in /dev/shm."""
    return os.path.exists(f"/dev/shm/{name}")


# ---- child process bodies (spawn) ----------------------------------------------------------


def exporter_child(conn: Connection, n: int, numel: int) -> None:
    """Allocate ``n`` shared segments filled with ``i + 1``, send their handles, then wait.

    The parent kills this process while it holds mappings of the segments.
    """
    backend = CpuBackend()
    owned = []
    handles: list[Any] = []
    for i in range(n):
        st = backend.alloc_shared((numel,), torch.float32)
        assert st.tensor is not None
        st.tensor.fill_(float(i + 1))
        owned.append(st)
        handles.append(backend.ipc_export(st.tensor))
    conn.send(handles)
    conn.recv()  # never answered: the parent kills us here


def opener_child(conn: Connection, handles: list[Any]) -> None:
    """Open the parent's segments, write into them, report, then wait to be killed."""
    backend = CpuBackend()
    owners = [backend.ipc_open(h) for h in handles]
    for o in owners:
        o.tensor.add_(1.0)
    conn.send(shm_mappings())
    conn.recv()  # never answered: the parent kills us here


def kill(pid: int) -> None:
    """SIGKILL ``pid`` (no cleanup in the victim)."""
    os.kill(pid, signal.SIGKILL)
