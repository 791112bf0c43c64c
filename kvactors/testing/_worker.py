"""One FIFO worker thread per fake stream: the engine of the fakes' asynchrony.

Device work is a closure queued on the stream and run later, in order, on the stream's thread
(after an optional seeded ``delay`` + ``jitter``); the submitter returns at once. Errors are
sticky: later work is skipped, markers carry the error and the next ``synchronize`` raises it.
Barriers (``wait_event``) block the worker until the awaited marker completed. A *lazy*
worker (knob ``lazy``) runs an item only once something waits for it (a ``synchronize``, a
wait on a marker behind it), so reading before waiting sees stale bytes every time.

Work runs under the autograd state its submitter had (inference mode, grad mode: both are
per thread in torch): a host thread's mode reaches the device work it enqueued, as on a card
where kernels know nothing of autograd, and an inference tensor allocated by the caller can be
filled by the worker.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import TYPE_CHECKING, Literal

import torch

from kvactors.testing._device import FakeDeviceError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("Marker", "StreamWorker", "under_callers_autograd")

_inference_enabled = torch.is_inference_mode_enabled
_grad_enabled = torch.is_grad_enabled


def under_callers_autograd(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn``, bound to run under the calling thread's autograd state wherever it runs.

    A fresh thread's state (grad mode on, inference mode off) is what a worker has, so work
    submitted from it is returned as is; under ``torch.inference_mode()`` or
    ``torch.no_grad()`` the work runs inside the same mode on the worker.
    """
    if _inference_enabled():

        def in_inference() -> object:
            with torch.inference_mode():
                return fn()

        return in_inference
    if not _grad_enabled():

        def without_grad() -> object:
            with torch.no_grad():
                return fn()

        return without_grad
    return fn


_Kind = Literal["work", "marker", "barrier"]


class Marker:
    """A point in one stream's queue; ``done`` is set once everything before it has run."""

    __slots__ = ("done", "error", "on_done", "release", "time")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.time = 0.0
        self.release: Callable[[], None] | None = None  # a lazy stream's work up to here
        self.on_done: Callable[[], None] | None = None

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the marker completed (at once if it has; ``fn`` is idempotent)."""
        self.on_done = fn
        if self.done.is_set():
            fn()

    def wait(self, timeout: float | None = None) -> bool:
        """Let a lazy stream run up to the marker, then wait for it; False on timeout."""
        if self.release is not None:
            self.release()
        return self.done.wait(timeout)

    def complete(self, error: BaseException | None) -> None:
        """Mark the point reached (carrying the stream's sticky error, if any)."""
        self.error = error
        self.time = time.perf_counter()
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class StreamWorker:
    """The FIFO queue and thread behind one fake stream."""

    def __init__(
        self, name: str, *, seed: int, delay: float, jitter: float, lazy: bool = False
    ) -> None:
        self.name = name
        self._queue: collections.deque[tuple[_Kind, Callable[[], object] | Marker]] = (
            collections.deque()
        )
        self._cv = threading.Condition()
        self._rng = random.Random(seed)
        self._delay = delay
        self._jitter = jitter
        self.submitted = 0
        self.completed = 0
        self._taken = 0
        self._allowed: float = 0 if lazy else float("inf")
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The worker thread (exposed so tests can check it is gone after exit)."""
        return self._thread

    def submit(self, fn: Callable[[], object]) -> None:
        """Enqueue device work (run under the caller's autograd state); returns immediately."""
        self._put("work", under_callers_autograd(fn))

    def submit_marker(self, marker: Marker) -> None:
        """Enqueue a marker that completes when all earlier work has run."""
        position = self._put("marker", marker)
        marker.release = lambda: self._release(position)

    def submit_barrier(self, marker: Marker) -> None:
        """Enqueue a wait: later work runs only after ``marker`` (of any stream) completed."""
        self._put("barrier", marker)

    def _put(self, kind: _Kind, item: Callable[[], object] | Marker) -> int:
        with self._cv:
            if self._stopping:
                raise FakeDeviceError(f"{self.name}: stream used after the fake was removed")
            self.submitted += 1
            self._queue.append((kind, item))
            self._cv.notify_all()
            return self.submitted

    def _release(self, upto: float) -> None:
        with self._cv:
            if upto > self._allowed:
                self._allowed = upto
                self._cv.notify_all()

    def idle(self) -> bool:
        """Whether every submitted item has run (``Stream.query``)."""
        with self._cv:
            return self.completed >= self.submitted

    def synchronize(self, *, clear_error: bool = True) -> None:
        """Block until everything submitted before the call ran; raise the sticky error."""
        with self._cv:
            target = self.submitted
            self._release(target)
            while self.completed < target and self._thread.is_alive():
                self._cv.wait(0.1)
            err = self.error
            if clear_error:
                self.error = None
        if err is not None:
            raise FakeDeviceError(f"{self.name}: {err}") from err

    def stop(self, timeout: float = 10.0) -> None:
        """Drain the queue and join the thread (idempotent)."""
        with self._cv:
            self._stopping = True
            self._allowed = float("inf")
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _pause(self) -> None:
        wait = self._delay + self._jitter * self._rng.random()
        if wait > 0:
            time.sleep(wait)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue and self._taken < self._allowed) and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                kind, item = self._queue.popleft()
                self._taken += 1
            if kind == "work":
                self._pause()
                if self.error is None:
                    try:
                        item()  # type: ignore[operator]
                    except BaseException as exc:
                        self.error = exc
            elif kind == "marker":
                assert isinstance(item, Marker)
                item.complete(self.error)
            else:
                assert isinstance(item, Marker)
                while not item.wait(0.1):
                    if self._stopping and not self._queue:
                        break
            # Drop the work (and the operands it holds) before it counts as done: memory a
            # synchronize waited for is freed by the time the synchronize returns.
            item = None  # type: ignore[assignment]
            with self._cv:
                self.completed += 1
                self._cv.notify_all()
