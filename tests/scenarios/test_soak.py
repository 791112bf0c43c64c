"""The soak benchmark runs as a script and exits 0 (bounded, small sizes): injected faults are
reported, none is silent."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_soak_benchmark_small() -> None:
    args = ["--transfers", "300", "--warmup", "50", "--fault-every", "100"]
    try:
        proc = subprocess.run(
            [sys.executable, "benchmarks/soak.py", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=40,  # a fence or reply that never came: fail, not hang
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"benchmarks/soak.py did not finish within 40 s: {exc.stdout!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: OK" in proc.stdout
    assert "silent 0" in proc.stdout
