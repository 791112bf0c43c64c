"""Debian's ``redis-server`` on loopback, the L2 of the deployment tests (LMCache's ``resp``)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvactors.errors import BackendUnavailableError
from kvactors_serving.server import free_port

__all__ = ("RedisServer", "redis_available")


def redis_available() -> bool:
    """Whether ``redis-server`` is on the path."""
    return shutil.which("redis-server") is not None


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 (no persistence, its own directory); :meth:`stop`."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise BackendUnavailableError(
                backend="redis-server", reason="not installed (apt-get install redis-server)"
            )
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvactors-redis-")
        cmd = [
            exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
            "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "yes",
            "--logfile", str(Path(self._dir.name) / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def command(self, *words: str, timeout: float = 5.0) -> bytes:
        """One RESP command (inline), its raw reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall((" ".join(words) + "\r\n").encode())
            return s.recv(65536)

    def keys(self) -> int:
        """``DBSIZE``: the number of keys stored."""
        reply = self.command("DBSIZE")
        return int(reply.strip().lstrip(b":"))

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Return once ``PING`` answers; raise if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    backend="redis-server", reason=f"exited {self.proc.returncode}"
                )
            with contextlib.suppress(OSError):
                if self.command("PING", timeout=1.0).startswith(b"+PONG"):
                    return
            time.sleep(0.1)  # bounded readiness poll of another process
        raise BackendUnavailableError(backend="redis-server", reason=f"not ready in {timeout} s")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._dir.cleanup()
        return self.proc.returncode
