"""F6: a process that used the kvactors_mlu plugin on the fake vendor with a borrowed stream
(as LMCache's MluDeviceOps would) exits without asyncio's "Task was destroyed but it is
pending!": interpreter exit stops every actor, borrowed-stream ones included."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import LMCACHE_MISSING, SCRIPTS, SKIP_REASON, lmcache_env

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def test_exit_after_plugin_use_with_a_borrowed_stream_leaves_no_pending_task() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "plugin_exit.py")],
        env=lmcache_env(KVACTORS_FAKE_VENDOR="mlu", KVACTORS_MLU_LAYOUT_SOURCE="resolved"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"
    assert "Task was destroyed" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
