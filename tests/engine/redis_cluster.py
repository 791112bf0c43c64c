"""A Redis Cluster of Debian's ``redis-server`` on loopback: LMCache's ``valkey`` L2 in
``cluster_mode``, for the deployment test of an L2 shared across nodes.

Every master runs in its own directory with an append-only file fsynced on every write, so a
master killed with SIGKILL and restarted on the same ports from the same directory (its
``nodes.conf`` and its data) rejoins with its slots and its keys. ``cluster-require-full-coverage
no``: while a master is down the others keep serving their slots (a cache loses only what the
dead master holds). :meth:`RedisCluster.stop` ends every process the cluster started.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

__all__ = ("RedisCluster",)

NODE_TIMEOUT_MS = 2000
"""``cluster-node-timeout``: how long a silent master takes to be marked failed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exe(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server)")
    return path


class RedisCluster:
    """``masters`` masters (no replicas) under ``root``; the slots spread by
    ``redis-cli --cluster create``."""

    def __init__(self, root: Path, masters: int = 3) -> None:
        self._server, self._cli = _exe("redis-server"), _exe("redis-cli")
        ports: set[int] = set()
        while len(ports) < 2 * masters:
            ports.add(_free_port())
        self.ports, self._bus = sorted(ports)[:masters], sorted(ports)[masters:]
        self._dirs = [root / f"master-{i}" for i in range(masters)]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * masters
        try:
            for i, d in enumerate(self._dirs):
                d.mkdir(parents=True)
                self.start(i)
        except BaseException:
            self.stop()  # the masters already started
            raise

    @property
    def startup_nodes(self) -> str:
        """The masters as the ``valkey`` adapter's ``startup_nodes`` string."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, i: int) -> None:
        """Start master ``i`` from its directory (again after :meth:`kill`)."""
        cmd = [
            self._server, "--bind", "127.0.0.1", "--port", str(self.ports[i]),
            "--cluster-enabled", "yes", "--cluster-port", str(self._bus[i]),
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage", "no", "--dir", str(self._dirs[i]),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--logfile", "redis.log", "--protected-mode", "yes",
        ]  # fmt: skip
        self._procs[i] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
        )

    def cli(self, i: int, *words: str, timeout: float = 10.0) -> str:
        """``redis-cli -p PORT WORDS...`` against master ``i``: its reply."""
        out = subprocess.run(
            [self._cli, "-h", "127.0.0.1", "-p", str(self.ports[i]), *words],
            capture_output=True, text=True, timeout=timeout, check=True,
        )  # fmt: skip
        return out.stdout.strip()

    def _wait(self, what: str, ok: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for i, proc in enumerate(self._procs):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"redis master {i} exited {proc.returncode}: {self.log(i)}")
            try:
                if ok():
                    return
            except (subprocess.SubprocessError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: {what} not reached in {timeout} s")
            time.sleep(0.2)  # bounded poll of other processes

    def create(self, timeout: float = 60.0) -> None:
        """Join the masters into one cluster, the slots spread evenly; return once every
        master reports ``cluster_state:ok``."""
        self._wait("PING", lambda: all(self.cli(i, "PING") == "PONG" for i in self._alive()), 30)
        subprocess.run(
            [self._cli, "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, timeout=60, check=True,
        )  # fmt: skip
        self.wait_ok(timeout)

    def _alive(self) -> list[int]:
        return [i for i, p in enumerate(self._procs) if p is not None and p.poll() is None]

    def _state_ok(self, i: int) -> bool:
        info = self.cli(i, "CLUSTER", "INFO")
        return "cluster_state:ok" in info and "cluster_slots_fail:0" in info

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Return once every running master reports the cluster ok with no failed slot."""
        self._wait("cluster_state:ok", lambda: all(self._state_ok(i) for i in self._alive()),
                   timeout)  # fmt: skip

    def wait_failed(self, i: int, timeout: float = 60.0) -> None:
        """Return once the other masters mark master ``i`` as failed (its slots ``fail``)."""
        others = [j for j in self._alive() if j != i]
        self._wait(
            f"master {i} marked failed",
            lambda: all("cluster_slots_fail:0" not in self.cli(j, "CLUSTER", "INFO")
                        for j in others),
            timeout,
        )  # fmt: skip

    def keys_per_master(self) -> list[int]:
        """``DBSIZE`` of every master (each holds only its own slots' keys)."""
        return [int(self.cli(i, "DBSIZE")) for i in range(len(self.ports))]

    def kill(self, i: int) -> None:
        """SIGKILL master ``i`` (a crash; its append-only file keeps what it acknowledged)."""
        proc, self._procs[i] = self._procs[i], None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def log(self, i: int) -> str:
        """The last 2000 characters of master ``i``'s log."""
        path = self._dirs[i] / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM every master still running, SIGKILL after 10 s."""
        for proc in self._procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
