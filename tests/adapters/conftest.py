"""Shared helpers for the LMCache adapter tests (lmcache 0.5.6 must be importable).

LMCache caches device detection and its plugin registry at ``import lmcache``, so anything
that needs the kvactors CPU plugin *selected* runs in a fresh interpreter
(:func:`run_script`). In-process tests only look at classes and the plugins' own methods.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

SCRIPTS = Path(__file__).parent / "scripts"
LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
SKIP_REASON = (
    "lmcache 0.5.6 is not installed; install it with "
    "PYTHON=.venv/bin/python scripts/install-lmcache.sh"
)


def lmcache_env(**extra: str) -> dict[str, str]:
    """Environment for an LMCache subprocess (plugin selection is left to ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVACTORS_"))}
    env.update(
        LMCACHE_TRACK_USAGE="false",
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_script(
    name: str, *args: str, env: dict[str, str], timeout: float = 120.0
) -> dict[str, Any]:
    """Run ``scripts/<name>`` in a fresh interpreter; return the JSON on its last line."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"{name} printed no JSON\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """A real ``python -m lmcache.v1.multiprocess.server`` on 127.0.0.1 (engine-driven)."""

    def __init__(self, *, shm_name: str | None, env: dict[str, str]) -> None:
        self.port = free_port()
        self.shm_name = shm_name
        cmd = [
            sys.executable, "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", "8", "--l1-size-gb", "0.05",
            "--supported-transfer-mode", "engine_driven",
            "--eviction-policy", "LRU", "--disable-metrics", "--hash-algorithm", "builtin",
        ]  # fmt: skip
        if shm_name:
            cmd += ["--shm-name", shm_name]
        self.log_path = (
            Path(os.environ.get("TMPDIR", "/tmp")) / f"kvactors-lmc-{uuid.uuid4().hex}.log"
        )
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            # Not yet listening: wait on the server process itself, so an exit ends this at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.1)
        raise AssertionError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def children(self) -> list[int]:
        try:
            import psutil

            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except Exception:
            return []

    def stop(self, timeout: float = 30.0) -> int:
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise AssertionError(f"server ignored SIGTERM:\n{self.log()}") from None
        finally:
            self._log.close()
        self.leftover = _still_alive(kids, timeout=15.0)
        return rc


def _still_alive(pids: list[int], timeout: float) -> list[int]:
    """Children that have not exited within ``timeout`` after their parent (teardown is
    asynchronous: a child learns of the parent's SIGTERM through its own signal or pipe)."""
    try:
        import psutil
    except ImportError:
        return []
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture
def lmcache_server_factory() -> Iterator[Any]:
    """Start servers on demand; every one is stopped (SIGTERM, then killed) at teardown."""
    started: list[LMCacheServer] = []

    def start(*, shm: bool, env: dict[str, str]) -> LMCacheServer:
        name = f"kvactors_l1_{uuid.uuid4().hex[:12]}" if shm else None
        srv = LMCacheServer(shm_name=name, env=env)
        started.append(srv)
        srv.wait_ready()
        return srv

    yield start
    for srv in started:
        if srv.proc.poll() is None:
            with contextlib.suppress(Exception):
                srv.stop()
        with contextlib.suppress(OSError):
            srv.log_path.unlink()
