"""Where a waiting call's time goes after its copy finished, on a fake vendor.

    KVACTORS_FAKE_VENDOR=mlu .venv/bin/python benchmarks/completion_hops.py mlu

The operands of ``kvactors bench``'s one-chunk part for NHD (``--quick``: the small model,
256 blocks, the fake's jitter), one thread, nothing between calls: per round 100 gathers of
each contender (bare route, kvactors waiting for the copy, kvactors returning once enqueued),
each followed by its stream's synchronize. For the calls that wait, it times the two thread
hand-offs between the copy's end and the caller's return: the stream's reaper waking from
its wait on the copy's event (after the fake stream marked the event complete), and the
caller waking from its wait on the reply (after the reaper settled it). Prints each
contender's time until done and the two hand-offs (median, 90th percentile, in
microseconds) beside one wake-up between two threads that do nothing else (the machine's own
cost of a hand-off). The timing wraps ``EventMarker.synchronize``, ``Reply.settle`` and
``Reply.wait`` for the run (restored after it).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any


def _q(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    xs = sorted(xs)
    p90 = xs[int(len(xs) * 0.9)]
    return f"median {statistics.median(xs) * 1e6:.0f}, p90 {p90 * 1e6:.0f} (n={len(xs)})"


def _bare_wakes(n: int = 2000) -> list[float]:
    """A ``threading.Event`` set by one thread and awaited by another, ``n`` times."""
    ev, back, lat, at = threading.Event(), threading.Event(), [], [0.0]

    def waiter() -> None:
        for _ in range(n):
            ev.wait()
            lat.append(time.perf_counter() - at[0])
            ev.clear()
            back.set()

    th = threading.Thread(target=waiter)
    th.start()
    for _ in range(n):
        time.sleep(0.0005)
        at[0] = time.perf_counter()
        ev.set()
        back.wait()
        back.clear()
    th.join()
    return lat


def main(kind: str, calls: int = 100, rounds: int = 3) -> int:
    import torch

    from kvactors.actors.reply import Reply
    from kvactors.cli._devenv import device_env
    from kvactors.cli.bench._pools import Pool
    from kvactors.cli.bench.transfer import _Caller, _contenders, _Dev, block_sets
    from kvactors.devices._torchlike import EventMarker
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    reaper: list[float] = []
    hops: list[float] = []
    settled: dict[int, float] = {}
    sync, settle, wait = EventMarker.synchronize, Reply.settle, Reply.wait

    def timed_sync(self: EventMarker) -> None:
        sync(self)
        now = time.perf_counter()
        marker = getattr(getattr(self.event, "_state", None), "marker", None)
        if marker is not None and threading.current_thread().name.startswith("reap:"):
            reaper.append(now - marker.time)  # the fake stream's completion time

    def timed_settle(self: Reply[Any], exc: BaseException | None, value: Any = None) -> bool:
        settled[id(self)] = time.perf_counter()
        return settle(self, exc, value)

    def timed_wait(self: Reply[Any], timeout: float, what: str) -> Any:
        got = wait(self, timeout, what)
        at = settled.pop(id(self), None)
        if at is not None:
            hops.append(time.perf_counter() - at)
        return got

    EventMarker.synchronize = timed_sync  # type: ignore[method-assign]
    Reply.settle = timed_settle  # type: ignore[method-assign]
    Reply.wait = timed_wait  # type: ignore[method-assign]
    done_us: dict[str, list[float]] = {}
    try:
        with device_env(kind) as env:
            if not env.simulated:
                raise SystemExit("this lab script reads the fake vendor's completion times")
            dev = _Dev(env)
            with Runtime(dev.backend, default_timeout=120.0) as rt:
                pool = Pool("small", "nhd", 256, 2, zeros=dev.zeros, pin=True)
                caller = _Caller(dev, pool, 0, block_sets(256, pool.bpo, 1))
                with dev.context(caller.stream)():
                    fns = _contenders(rt, dev, pool, caller, True, None)
                    for _ in range(rounds):
                        for name in ("bare", "kvactors", "kvactors_async"):
                            reaper_before, caller_before = len(reaper), len(hops)
                            for _ in range(calls):
                                t0 = time.perf_counter()
                                fns[name]()
                                caller.sync()
                                done_us.setdefault(name, []).append(time.perf_counter() - t0)
                            if name != "kvactors":  # its hand-offs alone
                                del reaper[reaper_before:], hops[caller_before:]
    finally:
        EventMarker.synchronize = sync  # type: ignore[method-assign]
        Reply.settle = settle  # type: ignore[method-assign]
        Reply.wait = wait  # type: ignore[method-assign]
    cells = ", ".join(f"{name} {_q(xs)}" for name, xs in done_us.items())
    print(f"{kind} NHD gather, one thread, us until done: {cells}")
    print(f"reaper wakes after the copy's event completed, us: {_q(reaper)}")
    print(f"caller wakes after the reaper settled its reply, us: {_q(hops)}")
    bare = _q(_bare_wakes())
    print(f"a thread wakes from an Event another thread set, nothing else running, us: {bare}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mlu"))
