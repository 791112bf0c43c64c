"""Issue 28 item 4's deterministic counts at the engine's call shape: Python frames and profile
events of one steady-state call of kvactors' op against LMCache's own CPU op, same process.

``benchmarks/call_footprint.py`` counts them in a fresh interpreter (every thread the runtime
starts is profiled from its start): vLLM CPU's format 12, 4 chunks, other block ids and
chunk buffers on every call. Targets: frames per call at most LMCache's, all profile events
(Python and C calls, every thread) at most 1.5x LMCache's, store and retrieve. Counts, not
times: the same on every run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="needs lmcache"),
]


def _counts(calls: int = 64) -> dict[str, Any]:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "call_footprint.py"), "--calls", str(calls)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    counts: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    print(json.dumps(counts, indent=1))  # the figures, with pytest -s
    return counts


@pytest.fixture(scope="module")
def counts() -> dict[str, Any]:
    return _counts()


def test_the_count_is_live_and_exact(counts: dict[str, Any]) -> None:
    assert counts["same_bytes"], "the counted op did not store what LMCache's op stores"
    for key in ("kvactors_store", "kvactors_retrieve", "lmcache_store", "lmcache_retrieve"):
        assert counts[key]["frames"] >= 1
        assert counts[key]["events"] >= counts[key]["frames"]
    # Twice the calls (two cycles of the 64 call sets): the same counts per call.
    again = _counts(128)
    assert {k: v for k, v in again.items() if k != "calls"} == {
        k: v for k, v in counts.items() if k != "calls"
    }


def test_the_op_costs_no_more_frames_than_lmcaches_and_at_most_1_5x_its_events(
    counts: dict[str, Any],
) -> None:
    for d in ("store", "retrieve"):
        kva, lmc = counts[f"kvactors_{d}"], counts[f"lmcache_{d}"]
        kva_events = kva["events"] + kva["other_threads"]
        lmc_events = lmc["events"] + lmc["other_threads"]
        assert kva["frames"] <= lmc["frames"], f"{d}: frames {kva['frames']} > {lmc['frames']}"
        assert kva_events <= 1.5 * lmc_events, f"{d}: events {kva_events} > 1.5 x {lmc_events}"
