"""Device-operation counters of a fake vendor: what one call cost the "device" and the host.

Fake entry points bump :class:`OpTally` fields as they happen: ``launches`` (kernels),
``h2d`` / ``d2h`` / ``d2d`` (copies; a host tensor passed to a kernel is an implicit upload
plus a sync), ``syncs`` (the host waited), ``allocations`` / ``alloc_bytes``. :class:`OpCounts`
is an immutable snapshot (subtract two for a window); counts are vendor-wide, so measure one
call at a time. ``OpCounter.threads`` names the host threads that did the counted operations.
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ("OpCounter", "OpCounts", "OpTally")


@dataclasses.dataclass(frozen=True)
class OpCounts:
    """A snapshot (or a difference) of a fake vendor's device-operation counters."""

    launches: int = 0
    h2d: int = 0
    d2h: int = 0
    d2d: int = 0
    syncs: int = 0
    allocations: int = 0
    alloc_bytes: int = 0

    @property
    def copies(self) -> int:
        """Copies in every direction."""
        return self.h2d + self.d2h + self.d2d

    @property
    def host_device_copies(self) -> int:
        """Copies that cross the host/device boundary (H2D plus D2H)."""
        return self.h2d + self.d2h

    def __sub__(self, other: OpCounts) -> OpCounts:
        return OpCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def as_dict(self) -> dict[str, int]:
        """The fields (and ``copies``) as a plain dict, for reports and JSON."""
        out = dataclasses.asdict(self)
        out["copies"] = self.copies
        return out


class OpTally:
    """The live, thread-safe counters behind a fake vendor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((f.name for f in dataclasses.fields(OpCounts)), 0)
        self._watchers: list[dict[str, None]] = []

    def add(self, field: str, n: int = 1) -> None:
        """Add ``n`` to ``field`` (done on the calling thread)."""
        with self._lock:
            self._values[field] += n
            if self._watchers:
                self._saw()

    def allocation(self, nbytes: int) -> None:
        """Count one device allocation of ``nbytes``."""
        with self._lock:
            self._values["allocations"] += 1
            self._values["alloc_bytes"] += nbytes
            if self._watchers:
                self._saw()

    def _saw(self) -> None:
        name = threading.current_thread().name
        for seen in self._watchers:
            seen[name] = None

    def watch(self, seen: dict[str, None]) -> None:
        """Record in ``seen`` the name of every thread that counts something from now on."""
        with self._lock:
            self._watchers.append(seen)

    def unwatch(self, seen: dict[str, None]) -> None:
        """Stop recording into ``seen``."""
        with self._lock:
            self._watchers = [w for w in self._watchers if w is not seen]

    def snapshot(self) -> OpCounts:
        """The counters now."""
        with self._lock:
            return OpCounts(**self._values)


class OpCounter:
    """``with fake.counting() as ops: ...``; then ``ops.counts`` holds what the block did.

    Inside the block ``ops.counts`` is what happened so far.
    """

    def __init__(self, tally: OpTally) -> None:
        self._tally = tally
        self._start = tally.snapshot()
        self._end: OpCounts | None = None
        self._threads: dict[str, None] = {}

    @property
    def counts(self) -> OpCounts:
        """Counts since the block started (final once it ended)."""
        end = self._end if self._end is not None else self._tally.snapshot()
        return end - self._start

    @property
    def threads(self) -> tuple[str, ...]:
        """Names of the host threads that did counted operations in the block, first first."""
        return tuple(self._threads)

    def __enter__(self) -> OpCounter:
        self._threads = {}
        self._tally.watch(self._threads)
        self._start = self._tally.snapshot()
        self._end = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._tally.snapshot()
        self._tally.unwatch(self._threads)
