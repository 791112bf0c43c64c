"""The one harness of ``kvactors bench``: the timing loop, result records, baselines.

Every figure is a ratio of contenders measured in the same run. :func:`rates` runs windows of
calls in one or more threads at once (each thread a :class:`Lane`, looping inside its own
context, e.g. its own stream), the contenders' windows rotated every round (two contenders run
ABBA), so drift hits all alike; it reports aggregate calls per second and each call's host time
until it returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import threading
import time
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Mapping, Sequence

__all__ = ("Lane", "Timing", "baseline", "progress", "rates")

K = TypeVar("K", bound="Hashable")


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    """One contender: median aggregate calls/s over its windows (all its threads) and, per
    tag of call, the median host time of one call in microseconds."""

    calls_per_s: float
    p50_us: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Lane:
    """One thread's work: ``calls`` (``(tag, call)`` pairs) cycled, the loop inside
    ``context()``; ``done()`` ends each window and is timed with it (e.g. a stream sync)."""

    calls: Sequence[tuple[str, Callable[[], object]]]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    done: Callable[[], object] = lambda: None


def _window(lanes: Sequence[Lane], calls: int) -> tuple[float, dict[str, list[float]]]:
    """Run ``calls`` calls on every lane at once (a single lane on this thread)."""
    start, t0 = threading.Barrier(len(lanes)), [0.0]
    lat: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def work(lane: Lane) -> None:
        mine: dict[str, list[float]] = {t: [] for t, _ in lane.calls}
        try:
            with lane.context():
                if start.wait() == 0:
                    t0[0] = time.perf_counter()
                for i in range(calls):
                    tag, fn = lane.calls[i % len(lane.calls)]
                    t1 = time.perf_counter()
                    fn()
                    mine[tag].append(time.perf_counter() - t1)
                lane.done()
        except BaseException as exc:  # raised again on the measuring thread
            errors.append(exc)
            start.abort()
        for t, v in mine.items():
            lat.setdefault(t, []).extend(v)

    threads = [threading.Thread(target=work, args=(ln,), daemon=True) for ln in lanes[1:]]
    for t in threads:
        t.start()
    work(lanes[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0[0], lat


def rates(contenders: Mapping[K, Sequence[Lane]], calls: int, rounds: int) -> dict[K, Timing]:
    """Per contender, ``rounds`` windows of ``calls`` calls on each of its lanes at once,
    the contenders' order rotated every round, after one untimed window each (warm-up)."""
    keys = list(contenders)
    for k in keys:
        _window(contenders[k], max(2, calls // 4))
    lat: dict[K, dict[str, list[float]]] = {k: {} for k in keys}
    cps: dict[K, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            wall, got = _window(contenders[k], calls)
            cps[k].append(calls * len(contenders[k]) / wall)
            for t, v in got.items():
                lat[k].setdefault(t, []).extend(v)

    return {
        k: Timing(
            calls_per_s=statistics.median(cps[k]),
            p50_us={t: statistics.median(v) * 1e6 for t, v in lat[k].items()},
        )
        for k in keys
    }


def baseline(name: str) -> Callable[..., Callable[[], object]] | None:
    """The ``kvactors.baselines`` entry point ``name`` (LMCache's ops come from the adapter,
    so kvactors itself never imports lmcache), or None when absent or not loadable."""
    for ep in entry_points(group="kvactors.baselines"):
        if ep.name == name:
            try:
                return ep.load()  # type: ignore[no-any-return]
            except Exception:
                return None
    return None


def progress(total: int) -> Callable[[str], None]:
    """A step counter printing ``[done/total] seconds label`` on stderr per finished step."""
    done, t0 = [0], time.perf_counter()

    def step(label: str) -> None:
        done[0] += 1
        print(f"[{done[0]}/{total}] {time.perf_counter() - t0:6.1f}s {label}", file=sys.stderr)

    return step
