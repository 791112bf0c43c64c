"""The one harness of ``kvactors bench``: the timing loop, result records, baselines, tables.

:func:`rates` runs windows of calls on one or more threads at once (each a :class:`Lane`, in
its own context, e.g. its own stream), the contenders' windows rotated every round (two
contenders run ABBA), and reports aggregate calls/s and each call's host time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

__all__ = ("Lane", "Timing", "baseline", "rates", "table")

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


def rates(
    contenders: Mapping[K, Sequence[Lane]],
    calls: int,
    rounds: int,
    warmed: Callable[[], object] | None = None,
) -> dict[K, Timing]:
    """Per contender, ``rounds`` windows of ``calls`` calls on each of its lanes at once,
    the contenders' order rotated every round, after one untimed window each (warm-up, then
    ``warmed()``: e.g. to drop samples the calls took themselves)."""
    keys = list(contenders)
    for k in keys:
        _window(contenders[k], max(2, calls // 4))
    if warmed is not None:
        warmed()
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


def table(title: str, head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """``title`` over a fixed-width text table (floats to 2 decimals, whole from 100 up);
    empty when there are no rows."""

    def cell(c: object) -> str:
        return f"{c:.{2 if abs(c) < 100 else 0}f}" if isinstance(c, float) else str(c)

    cells = [[str(c) for c in head]] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([title, *lines]) if len(cells) > 1 else ""
