"""The examples and the soak benchmark run as scripts and exit 0 (bounded, small sizes).

The preemption example must also show the race: the naive run corrupts chunks on every seed
tried (``--require-race``) while the fenced run stays clean.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # a fence or reply that never came: fail, not hang
        pytest.fail(f"{args[0]} did not finish within {timeout:.0f} s: {exc.stdout!r}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("device", "seed"), [("cpu", 1), ("cpu", 2), ("cpu", 3), ("mlu", 4), ("musa", 5)]
)
def test_preemption_example_shows_the_race_and_the_fence_ends_it(device: str, seed: int) -> None:
    args = ["--device", device, "--seed", str(seed), "--require-race"]
    if device != "cpu":
        args += ["--requests", "16"]
    out = _run("examples/preemption.py", *args, timeout=20)  # about 2 s when the rules hold
    line = next(ln for ln in out.splitlines() if "CORRUPTED committed chunks" in ln)
    naive, fenced = (int(x) for x in line.split()[-2:])
    assert naive > 0
    assert fenced == 0
    assert "RESULT: naive run committed" in out


def test_lmcache_worker_example_commits_every_store_bit_exact_in_order() -> None:
    # Not a sync-then-publish test: each store's gather is complete when transfer() returns,
    # so the record cannot overtake its bytes here (rule 1 is tested in tests/actors).
    assert "RESULT: OK" in _run("examples/lmcache_worker.py", "--stores", "32")


def test_ipc_cross_process_example() -> None:
    out = _run("examples/ipc_cross_process.py")
    assert "RESULT: OK" in out
    assert "server killed" in out
    assert "worker killed" in out


def test_soak_benchmark_small() -> None:
    out = _run(
        "benchmarks/soak.py", "--transfers", "300", "--warmup", "50", "--fault-every", "100",
        timeout=40,  # about 3 s when the rules hold
    )  # fmt: skip
    assert "RESULT: OK" in out
    assert "silent 0" in out
