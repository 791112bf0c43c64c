"""Lane threads: where device work runs, off the event loop.

One lane per stream: a FIFO thread that binds device and stream once and runs jobs in the
StreamActor's mailbox order. A launched job's marker and *lease* (callable and tensors) go to
the lane's reaper thread, which drops the lease and reports only once the marker completed
(rule 3). A StreamActor turn on a sender's thread launches there when the lane holds nothing;
its marker still queues behind every earlier one.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.devices.base import Backend, Marker, StreamLike

__all__ = ("Lane",)

_STOP = object()


class Lane:
    """A FIFO worker thread (plus a completion reaper) bound to one device stream."""

    def __init__(self, name: str, backend: Backend, index: int, stream: StreamLike) -> None:
        self.name = name
        self.backend = backend
        self.index = index
        self.stream = stream
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._watch: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._submitted = 0
        self._completed = 0
        #: Leases the reaper holds, and jobs queued or running (read without the lock: one
        #: read of a count written under it).
        self.watching = 0
        self.jobs = 0
        self._thread = threading.Thread(target=self._run, name=f"lane:{name}", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name=f"reap:{name}", daemon=True)
        self._bind_error: BaseException | None = None

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished (including launched work not yet completed)."""
        with self._lock:
            return self._submitted - self._completed

    @property
    def completed(self) -> int:
        """Jobs finished so far."""
        with self._lock:
            return self._completed

    def start(self) -> None:
        """Start the lane and reaper threads."""
        self._thread.start()
        self._reaper.start()

    def submit(self, job: Callable[[], object]) -> None:
        """Queue ``job`` behind every job submitted before it."""
        with self._lock:
            self._submitted += 1
            self.jobs += 1
        self._queue.put(job)

    def jobs_idle(self) -> bool:
        """Whether no job is queued or running (launched work may still be watched)."""
        return self.jobs == 0  # one read of a count changed under the lock: no lock needed

    def reaper_idle(self) -> bool:
        """Whether the reaper holds no lease (so a completed launch may answer directly)."""
        return self.watching == 0

    def watch(
        self, marker: Marker, lease: Any, done: Callable[[BaseException | None], None]
    ) -> bool:
        """Hold ``lease`` until ``marker`` completed, then call ``done`` (from the reaper).
        Returns True (for ``watched = lane.watch(...)``)."""
        with self._lock:
            self._submitted += 1
            self.watching += 1
        self._watch.put((marker, lease, done))
        return True

    def after_reaped(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the reaper) once every lease watched before now was dropped."""
        with self._lock:
            self._submitted += 1
        self._watch.put((None, None, fn))

    def stop(self, timeout: float | None) -> bool:
        """Let queued jobs finish, then end both threads; False if they did not end in time."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False  # abandoned: the lane stops its reaper itself if it ever ends
        self._reaper.join(timeout)
        return not self._reaper.is_alive()

    def _finish_one(self) -> None:
        with self._lock:
            self._completed += 1

    def _run(self) -> None:
        try:
            self.backend.bind_thread(self.index, self.stream)
        except BaseException as exc:  # reported to every job below
            self._bind_error = exc
        while True:
            job = self._queue.get()
            if job is _STOP:
                # Everything launched before was handed to the reaper: it drops those leases
                # first, then ends. Done here, not in stop(), so that a lane stop() gave up
                # on (a device that hung, then recovered) does not leave its reaper behind.
                self._watch.put(_STOP)
                return
            try:
                job()
            finally:
                del job
                with self._lock:
                    self._completed += 1
                    self.jobs -= 1

    def _reap(self) -> None:
        while True:
            item = self._watch.get()
            if item is _STOP:
                return
            marker, lease, done = item
            del item
            if marker is None:
                try:
                    done()
                finally:
                    del done
                    self._finish_one()
                continue
            err: BaseException | None = None
            try:
                marker.synchronize()
            except BaseException as exc:
                err = exc
            del lease
            with self._lock:
                self.watching -= 1
            try:
                done(err)
            finally:
                del marker, done
                self._finish_one()

    @property
    def bind_error(self) -> BaseException | None:
        """Why binding the device/stream on the lane thread failed, if it did."""
        return self._bind_error
