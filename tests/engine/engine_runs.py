"""Engine processes of the deployment tests and the checks on their results.

An engine process is ``python -m kvactors_serving.engine SPEC OUT`` (vLLM's offline engine,
prompts one at a time); its results are JSON. Every engine taps the KV through
``KVACTORS_SERVING_TAP`` into one directory, so a restore in one process is compared bit for
bit with the blocks another process stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

__all__ = ("bits", "kv_checks", "poll_until", "run_engine", "warm")

T = TypeVar("T")


def poll_until(
    what: str, probe: Callable[[], T], done: Callable[[T], bool], *, timeout: float = 60.0
) -> T:
    """``probe()`` until ``done`` holds for its value; that value. A bounded poll of another
    process's state (an L2 that LMCache's servers write asynchronously), not a race cover:
    fails with ``what`` and the last value past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done(value := probe()):
        assert time.monotonic() < deadline, f"{what}: {value!r} after {timeout:.0f} s"
        time.sleep(0.2)
    return value


def run_engine(
    work: Path, spec: dict[str, Any], env: dict[str, str], *, timeout: float = 600.0
) -> dict[str, Any]:
    """One engine process; its results. Fails when it exits non-zero or runs past ``timeout``
    seconds (it is killed then)."""
    spec_path, out_path = work / f"{spec['name']}.spec.json", work / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"{spec['name']}.log"
    with log_path.open("wb") as log:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "kvactors_serving.engine", str(spec_path),
                 str(out_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            tail = log_path.read_text(errors="replace")[-3000:]
            msg = f"engine {spec['name']} ran past {timeout:.0f} s:\n{tail}"
            raise AssertionError(msg) from None
    tail = log_path.read_text(errors="replace")[-3000:]
    assert proc.returncode == 0, tail
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def warm(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The first run of the ``warm_single`` phase: one output per warm prompt."""
    runs: list[list[dict[str, Any]]] = result["phases"]["warm_single"]
    return runs[0]


def bits(o: dict[str, Any]) -> list[Any]:
    """An output's tokens and logprob bits (each step's logprob and top two)."""
    return [o["tokens"], [(s["logprob"], s["top2"]) for s in o["steps"]]]


def kv_checks(result: dict[str, Any]) -> None:
    """kvactors restored what LMCache served, every restored chunk equals the blocks an earlier
    engine stored, and kvactors reported no failure."""
    from kvactors_serving.workload import CHUNK

    tap, rt = result["tap"], result["runtime"]
    hits = sum(o["hit"] for o in warm(result))
    assert tap["chunks_restored"] * CHUNK == hits > 0  # kvactors restored what LMCache served
    assert tap["chunks_compared"] == tap["chunks_restored"]  # every one stored by an earlier engine
    assert tap["chunks_unknown"] == 0
    assert tap["mismatches"] == []
    assert rt["transfers_failed"] == 0
    assert rt["transfers_ok"] == tap["op_calls"]["store"] + tap["op_calls"]["retrieve"]
