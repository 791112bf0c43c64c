"""The exporter process of the cross-process IPC check in :mod:`kvactors.testing.conformance.check`.

It allocates a zeroed buffer, exports it with the backend's ``ipc_export`` and sends the
wire-safe :class:`~kvactors.devices.base.IPCHandle` (never a pointer) to the parent, which
opens it, queues writes and closes the context; the exporter then reads without waiting for
the parent's streams, so a close that returned early shows as stale bytes.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from typing import IO, Any

import msgspec
import torch

from kvactors.devices.base import IPCHandle
from kvactors.errors import UnsupportedOperationError

__all__ = ("Exporter", "pattern")

_TIMEOUT = 120.0
_MARK = "kvactors-selftest-exporter "


def pattern(n: int) -> torch.Tensor:
    """The bytes the parent writes into the exported buffer."""
    return torch.arange(n, dtype=torch.float32)


def _say(out: IO[str], tag: str, value: Any) -> None:
    out.write(_MARK + json.dumps([tag, value]) + "\n")
    out.flush()


def _serve(kind: str, index: int, n: int) -> None:
    """The exporter process: export, hand out the handle, verify on request, free."""
    from kvactors.devices import get_backend

    out = sys.stdout
    shared: Any = None
    try:
        backend = get_backend(kind)
        if kind == "cpu":
            shared = getattr(backend, "alloc_shared")((n,), torch.float32)  # noqa: B009
            buf = shared.tensor
        else:
            buf = torch.zeros(n, device=backend.device(index))
            getattr(torch, kind).synchronize(index)
        handle = backend.ipc_export(buf)
        _say(out, "handle", msgspec.json.encode(handle).decode())
        if sys.stdin.readline().strip() == "verify":
            seen = buf.clone() if kind == "cpu" else buf.to("cpu")
            _say(out, "verified", bool(torch.equal(seen, pattern(n))))
        del buf
    except UnsupportedOperationError as exc:
        _say(out, "unsupported", str(exc))
    except Exception as exc:
        _say(out, "error", f"{type(exc).__name__}: {exc}")
    finally:
        if shared is not None:
            with contextlib.suppress(Exception):
                shared.close()


class Exporter:
    """A child exporter process of ``n`` float32 elements on ``kind:index``.

    A plain subprocess (``python -m``), not multiprocessing: the caller's main module is
    never re-imported, so scripts without a ``__main__`` guard can run the suite.
    """

    def __init__(self, kind: str, index: int, n: int) -> None:
        self._kind = kind
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, kind, str(index), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        # A reader thread, so that every wait for the child has a deadline.
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(
            target=self._read, daemon=True, name="kvactors-selftest-exporter-reader"
        )
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(_MARK):  # vendor libraries may print banners
                self._lines.put(line.removeprefix(_MARK))
        self._lines.put("")

    def _recv(self, expected: str) -> Any:
        try:
            line = self._lines.get(timeout=_TIMEOUT)
        except queue.Empty:
            raise TimeoutError(
                f"the exporter process sent no {expected!r} in {_TIMEOUT:.0f}s"
            ) from None
        if not line:
            code = self._proc.wait(_TIMEOUT)
            raise RuntimeError(f"the exporter process exited ({code}) without {expected!r}")
        tag, value = json.loads(line)
        if tag == "unsupported":
            raise UnsupportedOperationError(f"exporter process: {value}", backend=self._kind)
        if tag == "error":
            raise RuntimeError(f"exporter process: {value}")
        if tag != expected:
            raise RuntimeError(f"exporter process sent {tag!r}, expected {expected!r}")
        return value

    def handle(self) -> IPCHandle:
        """The exported buffer's handle (decoded from the wire)."""
        return msgspec.json.decode(self._recv("handle"), type=IPCHandle)

    def verify(self) -> bool:
        """Whether the exporter now reads :func:`pattern` in its buffer."""
        assert self._proc.stdin is not None
        self._proc.stdin.write("verify\n")
        self._proc.stdin.flush()
        return bool(self._recv("verified"))

    def close(self) -> None:
        """Stop the exporter (it frees its buffer) and reap it."""
        if self._proc.stdin is not None:
            with contextlib.suppress(Exception):
                self._proc.stdin.close()
        try:
            self._proc.wait(_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(_TIMEOUT)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
