"""LMCache's MP server on loopback, started and stopped by the serving validation."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvactors.errors import BackendUnavailableError

__all__ = ("HASH_ALGORITHM", "LMCacheServer", "free_port", "server_command")

HASH_ALGORITHM = "blake3"
"""The server's token hash: the same in every process and after a restart (LMCache's
``builtin`` is Python's ``hash()``, which is not, so a restarted server finds nothing its L2
holds)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    python: str,
    port: int,
    chunk_size: int,
    *,
    hash_algorithm: str = HASH_ALGORITHM,
    l2_adapters: tuple[dict[str, object], ...] = (),
    max_workers: int | None = None,
) -> list[str]:
    """The server's command line (engine-driven transfers, blake3 hashing, no metrics; each of
    ``l2_adapters`` one ``--l2-adapter`` JSON spec; ``max_workers``: the threads of each of its
    request pools, LMCache's default 1)."""
    cmd = [
        python, "-m", "lmcache.v1.multiprocess.server",
        "--host", "127.0.0.1", "--port", str(port),
        "--chunk-size", str(chunk_size), "--l1-size-gb", "0.2",
        "--supported-transfer-mode", "engine_driven",
        "--eviction-policy", "LRU", "--disable-metrics", "--hash-algorithm", hash_algorithm,
    ]  # fmt: skip
    for spec in l2_adapters:
        cmd += ["--l2-adapter", json.dumps(spec)]
    if max_workers is not None:
        cmd += ["--max-workers", str(max_workers)]
    return cmd


class LMCacheServer:
    """One server process; :meth:`wait_ready` polls its port, :meth:`stop` sends SIGTERM."""

    def __init__(
        self,
        *,
        chunk_size: int,
        env: dict[str, str],
        python: str | None = None,
        hash_algorithm: str = HASH_ALGORITHM,
        l2_adapters: tuple[dict[str, object], ...] = (),
        max_workers: int | None = None,
    ) -> None:
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix="kvactors-lmcache-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            server_command(
                python or sys.executable,
                self.port,
                chunk_size,
                hash_algorithm=hash_algorithm,
                l2_adapters=l2_adapters,
                max_workers=max_workers,
            ),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Return once the port accepts connections; raise if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    backend="lmcache server",
                    reason=f"exited {self.proc.returncode}:\n{self.log()}",
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.2)  # bounded readiness poll of another process
        raise BackendUnavailableError(
            backend="lmcache server", reason=f"not ready in {timeout:.0f} s:\n{self.log()}"
        )

    def log(self) -> str:
        """The last 6000 characters of the server's log."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL to the process group after ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
        return self.proc.returncode
