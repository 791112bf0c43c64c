"""Transfer latency histograms a runtime keeps in line, per calling thread, summed on read.

A transfer adds its seconds to its own thread's counts with plain list stores: no lock and
no Python call on the call's path (the runtime writes them in line; a thread's first call
makes its counts). A reader (the metrics mirror, any thread) sums every thread's counts;
each count only grows, so two reads never go backwards.
"""

from __future__ import annotations

import threading

__all__ = ("LATENCY_BOUNDS", "Latency")

LATENCY_BOUNDS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms' buckets (then +Inf)."""


class Latency:
    """One runtime's transfer latency: per thread ``len(LATENCY_BOUNDS) + 1`` bucket counts
    (not cumulative, the last is +Inf), then the seconds, in ``local.transfer``."""

    __slots__ = ("_all", "_lock", "local")

    def __init__(self) -> None:
        self.local = threading.local()
        self._lock = threading.Lock()
        self._all: list[list[float]] = []

    def mine(self) -> list[float]:
        """The calling thread's counts, made on its first call."""
        counts: list[float] = [0] * (len(LATENCY_BOUNDS) + 1) + [0.0]
        with self._lock:
            self._all.append(counts)
        self.local.transfer = counts
        return counts

    def snapshot(self) -> tuple[tuple[int, ...], float]:
        """Every thread's counts summed: per bucket (then +Inf), and the seconds."""
        with self._lock:
            every = list(self._all)
        n = len(LATENCY_BOUNDS) + 1
        buckets = [0] * n
        seconds = 0.0
        for counts in every:
            now = list(counts)  # one read of the whole list
            for i in range(n):
                buckets[i] += int(now[i])
            seconds += now[n]
        return tuple(buckets), seconds
