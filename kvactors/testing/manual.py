"""ManualBackend: a CPU-backed device whose streams run only when its driver says so
(``examples/preemption.py`` steps it from a device-clock thread).

Theory of operation. Ordering bugs are races, and a race test is only as good as its control
over the race. ManualBackend behaves like an accelerator whose execution the test drives
step by step: ``launch`` only *enqueues* work on the stream's device queue and returns at once;
nothing runs until the test calls :meth:`ManualBackend.release`. ``synchronize`` and markers
block the calling (lane) thread until the queue drained, exactly like a device sync.

Like a real device, the queue does not keep Python objects alive: it holds a weak reference
to each launched callable. If the runtime dropped its own reference before the work ran, the
work is lost and counted in :attr:`ManualBackend.use_after_free`, which is what a real device
does to freed memory, only visibly. IPC owners opened through it record whether they were
closed while device work was still queued (:attr:`ManualBackend.closed_under_work`).

Tests wait for states with :meth:`ManualBackend.wait_for`, which blocks on a condition
variable notified at every state change; no sleeping, no polling of wall time.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from kvactors.devices.cpu import CpuBackend, CpuStream

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvactors.devices.base import IPCHandle, IPCOwner, Marker, StreamLike

__all__ = ("ManualBackend",)


class _Queue:
    def __init__(self) -> None:
        self.ops: list[weakref.ref[Callable[[], None]]] = []
        self.submitted = 0
        self.executed = 0


class _ManualMarker:
    def __init__(self, backend: ManualBackend, queue: _Queue, position: int) -> None:
        self._backend = backend
        self._queue = queue
        self._position = position

    def query(self) -> bool:
        with self._backend._cond:
            return self._queue.executed >= self._position

    def synchronize(self) -> None:
        self._backend._wait_executed(self._queue, self._position)


class _ManualOwner:
    def __init__(self, backend: ManualBackend, inner: IPCOwner) -> None:
        self._backend = backend
        self._inner = inner

    @property
    def tensor(self) -> torch.Tensor:
        return self._inner.tensor

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def close(self) -> None:
        if not self._inner.closed:
            with self._backend._cond:
                if self._backend.queued() > 0:
                    self._backend.closed_under_work += 1
                self._backend.owners_closed += 1
                self._backend._cond.notify_all()
        self._inner.close()


class ManualBackend(CpuBackend):
    """A CPU backend whose streams execute launched work only on :meth:`release`.

    ``auto=True`` runs work as soon as it is launched (still through the weak-reference
    queue), for tests that need an asynchronous-looking device without stepping it.
    """

    kind = "cpu"

    def __init__(self, *, auto: bool = False) -> None:
        super().__init__()
        self.auto = auto
        self._cond = threading.Condition()
        self._queues: dict[int, _Queue] = {}
        self.use_after_free = 0
        self.sync_waiters = 0
        self.closed_under_work = 0
        self.owners_closed = 0

    def _queue(self, stream: StreamLike) -> _Queue:
        assert isinstance(stream, CpuStream)
        with self._cond:
            q = self._queues.get(stream.handle)
            if q is None:
                q = self._queues[stream.handle] = _Queue()
            return q

    def queued(self, handle: int | None = None) -> int:
        """Launched work not yet executed (on ``handle``, or on every stream)."""
        with self._cond:
            qs = self._queues.values() if handle is None else [self._queues.get(handle, _Queue())]
            return sum(q.submitted - q.executed for q in qs)

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        """Enqueue ``fn`` (weakly referenced) on the stream's device queue."""
        q = self._queue(stream)
        with self._cond:
            q.ops.append(weakref.ref(fn))
            q.submitted += 1
            self._cond.notify_all()
        if self.auto:
            self.release(stream_handle=self.stream_handle(stream))

    def release(self, n: int | None = None, *, stream_handle: int | None = None) -> int:
        """Execute up to ``n`` queued pieces of work (all if None), FIFO per stream."""
        done = 0
        while n is None or done < n:
            with self._cond:
                q = next(
                    (
                        q
                        for h, q in self._queues.items()
                        if q.ops and (stream_handle is None or h == stream_handle)
                    ),
                    None,
                )
                if q is None:
                    break
                ref = q.ops.pop(0)
            fn = ref()
            if fn is None:
                with self._cond:
                    self.use_after_free += 1
            else:
                try:
                    fn()
                finally:
                    del fn
            with self._cond:
                q.executed += 1
                self._cond.notify_all()
            done += 1
        return done

    def _wait_executed(self, q: _Queue, position: int) -> None:
        with self._cond:
            self.sync_waiters += 1
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: q.executed >= position)
            finally:
                self.sync_waiters -= 1
                self._cond.notify_all()

    def synchronize(self, stream: StreamLike) -> None:
        """Block until everything launched on ``stream`` so far was released and ran."""
        q = self._queue(stream)
        with self._cond:
            position = q.submitted
        self._wait_executed(q, position)

    def record_marker(self, stream: StreamLike) -> Marker:
        """A marker completing when the work launched so far on ``stream`` ran."""
        q = self._queue(stream)
        with self._cond:
            return _ManualMarker(self, q, q.submitted)

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        """Open as the CPU backend does, recording closes that happen under queued work."""
        return _ManualOwner(self, super().ipc_open(handle))

    def wait_for(self, predicate: Callable[[ManualBackend], bool], timeout: float = 10.0) -> bool:
        """Block until ``predicate(self)`` holds (re-checked at every state change)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)
