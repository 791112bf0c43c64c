"""Reading kvactors' metrics from vLLM's own ``/metrics`` (its multiprocess mode).

kvactors mirrors its counters into prometheus_client in the engine-core (or worker) process;
with ``PROMETHEUS_MULTIPROC_DIR`` set, vLLM's API server adds up every process's files. The
mirror passes every ``KVACTORS_METRICS_INTERVAL`` seconds, so a reader waits for the state it
expects (bounded), never for a time.
"""

from __future__ import annotations

import time
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

#: Every kvactors family the mirror exports, as the scrape names them.
FAMILIES = frozenset(
    {"kvactors_transfers_total", "kvactors_bytes_moved_total", "kvactors_call_latency_seconds"}
)

Key = tuple[str, frozenset[tuple[str, str]]]


def metrics_env(directory: Path) -> dict[str, str]:
    """The environment that puts kvactors' metrics in vLLM's /metrics (an empty directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    assert not any(directory.iterdir()), "PROMETHEUS_MULTIPROC_DIR must be empty at start"
    return {"PROMETHEUS_MULTIPROC_DIR": str(directory), "KVACTORS_METRICS_INTERVAL": "0.2"}


def scrape(port: int) -> dict[Key, float]:
    """vLLM's /metrics: every sample, keyed by name and its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(m: dict[Key, float], name: str, **labels: str) -> float:
    """One sample (0 when absent: a counter vLLM's collector has not seen yet)."""
    return m.get((name, frozenset({"device": "cpu:0", **labels}.items())), 0.0)


def families(m: dict[Key, float]) -> set[str]:
    """The kvactors families in a scrape."""
    out = set()
    for name, _ in m:
        if name.startswith("kvactors_"):
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and name.removesuffix(suffix) in FAMILIES:
                    name = name.removesuffix(suffix)
            out.add(name)
    return out


def wait_for(
    port: int, ready: Callable[[dict[Key, float]], bool], *, timeout: float = 60.0
) -> dict[Key, float]:
    """Scrape until ``ready(scrape)`` holds; the last scrape (the test's asserts say why not)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)  # the next scrape: polling a state, bounded by the deadline
