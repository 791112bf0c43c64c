"""Messaging benchmark: the runtime's hops against their bare asyncio/threading floors.

Two ratios, each measured in one run with interleaved repetitions:

* ``ask``: an ``await actor.ask(Ping())`` round trip through a GatherActor (bounded mailbox,
  protocol check, deadline timer, reply future) against a bare ``asyncio.Queue`` + ``Future``
  ask served by a minimal task.
* ``blocking``: ``Runtime.ping()`` from a foreign thread against a bare
  ``call_soon_threadsafe`` round trip onto the same loop thread (the runtime's), so both pay
  the same thread wake-ups.

Run: ``python -m kvactors.cli.bench.messaging`` (prints medians in microseconds and the ratios).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

import msgspec

from kvactors.actors.group import DeviceActors
from kvactors.devices.cpu import CpuBackend
from kvactors.protocols.gather import Ping
from kvactors.runtime import Runtime

__all__ = ("MessagingResult", "run_messaging_bench")


class MessagingResult(msgspec.Struct, frozen=True, kw_only=True):
    """Median round trips in microseconds, and the ratios against the floors."""

    ask_us: float
    bare_ask_us: float
    ask_ratio: float
    blocking_us: float
    bare_thread_us: float
    blocking_ratio: float


async def _bare_server(q: asyncio.Queue[tuple[Any, asyncio.Future[Any]]]) -> None:
    while True:
        msg, fut = await q.get()
        fut.set_result(msg)


async def _ask_rounds(n: int, reps: int) -> tuple[list[float], list[float]]:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue(maxsize=1024)
    server = loop.create_task(_bare_server(q))
    ours: list[float] = []
    bare: list[float] = []
    async with DeviceActors(CpuBackend()) as dev:
        actor = dev.gather
        ping = Ping(seq=1)
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                await actor.ask(ping, timeout=60.0)
            ours.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n):
                fut = loop.create_future()
                q.put_nowait((ping, fut))
                await fut
            bare.append((time.perf_counter() - t0) / n)
    server.cancel()
    return ours, bare


def _thread_rounds(n: int, reps: int) -> tuple[list[float], list[float]]:
    # Both contenders hop onto the same loop thread (the runtime's own), so thread placement
    # and wake-up latency, which dominate on small VMs, are identical for the two.
    ours: list[float] = []
    bare: list[float] = []
    with Runtime("cpu") as rt:
        rt.ping()
        loop = rt._loop
        assert loop is not None
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                rt.ping()
            ours.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            for _ in range(n):
                done = threading.Lock()
                done.acquire()
                loop.call_soon_threadsafe(done.release)
                done.acquire()
            bare.append((time.perf_counter() - t0) / n)
    return ours, bare


def run_messaging_bench(*, n: int = 2000, reps: int = 15) -> MessagingResult:
    """Measure both ratios; medians over ``reps`` repetitions of ``n`` round trips each."""
    ours, bare = asyncio.run(_ask_rounds(n, reps))
    tours, tbare = _thread_rounds(max(n // 4, 1), reps)
    a, b = statistics.median(ours) * 1e6, statistics.median(bare) * 1e6
    c, d = statistics.median(tours) * 1e6, statistics.median(tbare) * 1e6
    return MessagingResult(
        ask_us=a,
        bare_ask_us=b,
        ask_ratio=a / b,
        blocking_us=c,
        bare_thread_us=d,
        blocking_ratio=c / d,
    )


def main() -> None:
    """Print the figures."""
    r = run_messaging_bench()
    print(
        f"ask through an actor    {r.ask_us:8.2f} us  bare Queue+Future     "
        f"{r.bare_ask_us:8.2f} us  ratio {r.ask_ratio:.2f} (target <= 1.25)"
    )
    print(
        f"blocking call (thread)  {r.blocking_us:8.2f} us  call_soon_threadsafe  "
        f"{r.bare_thread_us:8.2f} us  ratio {r.blocking_ratio:.2f} (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
