"""The runtime: one event-loop thread per process and a thread-safe facade onto the actors.

A :class:`Runtime` owns a private asyncio loop running in its own daemon thread, and on it the
:class:`~kvactors.actors.group.DeviceActors` of one device: one set of actors and counters,
with two drivers. The mailbox: a call is a message to an actor (``Transfer``, ``Fence`` and
``Ping`` to the GatherActor, ``Sync`` and the records to a StreamActor, the IPC messages to
the IPCOwnerActor), sent from the calling thread, which runs the turn itself when the actor is
idle (else the loop runs it, in mailbox order), and the caller sleeps on its
:class:`~kvactors.actors.reply.Reply` until the reply is settled. The plain call: a blocking
transfer whose actors are idle takes their turns on the calling thread without a message
(:meth:`GatherActor.transfer_now <kvactors.actors.gather.GatherActor.transfer_now>`, the same
planning and launch as the turns'), and its return value is the reply. Both drivers keep the
same counters, on every device. Asyncio callers use the ``a*`` twins: they queue the
message from their own thread (never running a turn, so their loop never waits for device
work) and await the same kind of reply, under asyncio or trio (see
:mod:`kvactors.actors.reply`).

Every blocking call has a deadline (``default_timeout`` unless given). ``close`` stops the
actors down their graph with a bounded grace period: a call that was never enqueued fails with
:class:`~kvactors.errors.ActorClosedError` (not served), a transfer the close gave up on with
:class:`~kvactors.errors.TransferAbandonedError` (it may still land).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import functools
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any

from kvactors.actors.gather import TransferOperands
from kvactors.actors.group import DeviceActors, DeviceStatistics
from kvactors.actors.reply import Reply
from kvactors.core.protocols.gather import Fence, Fenced, Ping, Pong, Transfer, TransferDone
from kvactors.core.protocols.ipc import CloseContext, ContextClosed, Opened, OpenHandle
from kvactors.core.protocols.stream import EventRecord, RecordCompletion, RecordEvent, Sync, Synced
from kvactors.devices.base import Backend
from kvactors.errors import (
    ActorClosedError,
    DeviceOpError,
    MailboxFullError,
    TransferAbandonedError,
)
from kvactors.runtime._latency import LATENCY_BOUNDS, Latency
from kvactors.runtime.observer import Call, Observers

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    import torch

    from kvactors.core.plans import TransferRequest
    from kvactors.devices.base import IPCHandle
    from kvactors.runtime.observer import RuntimeObserver

__all__ = ("Runtime", "get_runtime", "resolve_backend")


_GRACE = 2.0


def resolve_backend(backend: str | Backend) -> Backend:
    """A backend instance for a kind name (``cpu``, ``mlu``, ``musa``, ``cuda``) or itself."""
    if isinstance(backend, Backend):
        return backend
    from kvactors.devices import get_backend

    return get_backend(backend)


_clock = time.perf_counter
_bucket = bisect.bisect_left  # a value equal to a bound is in that bound's bucket (le)
_BOUNDS = LATENCY_BOUNDS


class Runtime:
    """The kvactors runtime of one device in this process.

    ``Runtime("cpu")`` (or ``"mlu"``, ``"musa"``, ``"cuda"``, or a :class:`Backend`) starts on
    first use or with :meth:`start`, and is a context manager. Blocking methods are safe from
    any thread except the runtime's own loop thread; ``a*`` methods serve asyncio callers.
    """

    def __init__(
        self,
        backend: str | Backend = "cpu",
        *,
        device_index: int = 0,
        capacity: int = 1024,
        default_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        observer: RuntimeObserver | None = None,
    ) -> None:
        self.backend = resolve_backend(backend)
        self.device_index = device_index
        self.default_timeout = default_timeout
        self._capacity = capacity
        self._stop_timeout = stop_timeout
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._actors: DeviceActors | None = None
        self._closed = False
        self._ids = itertools.count(1)
        self._outstanding: dict[Reply[Any], object] = {}
        self._observers = Observers()
        self._latency = Latency()
        if observer is not None:
            self._observers.add(observer)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> Runtime:
        """Check the backend, start the loop thread and the actors; idempotent."""
        with self._lock:
            if self._closed:
                raise ActorClosedError("runtime is closed", actor="runtime")
            if self._loop is not None:
                return self
            self.backend.require()
            self.backend.device(self.device_index)
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            failure: list[BaseException] = []

            async def start_actors(actors: DeviceActors) -> None:
                # On the loop (actors start on the running loop), and awaited here so that a
                # failed start fails start() instead of leaving actors that never started.
                try:
                    actors.start()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await actors.stop(timeout=self._stop_timeout)
                    raise

            def run() -> None:
                asyncio.set_event_loop(loop)
                try:
                    actors = DeviceActors(
                        self.backend,
                        self.device_index,
                        capacity=self._capacity,
                        stop_timeout=self._stop_timeout,
                    )
                    loop.run_until_complete(start_actors(actors))
                    self._actors = actors
                except BaseException as exc:
                    failure.append(exc)
                    loop.close()
                    ready.set()
                    return
                loop.call_soon(ready.set)
                try:
                    loop.run_forever()
                finally:
                    loop.close()

            thread = threading.Thread(target=run, name="kvactors-loop", daemon=True)
            thread.start()
            ready.wait()
            if failure:
                raise failure[0]
            self._loop, self._thread = loop, thread
            return self

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self, timeout: float | None = None, *, grace: float = _GRACE) -> None:
        """Stop the actors (bounded), then the loop; idempotent. Pending calls fail.

        Args:
            timeout: The actors' stop timeout (default: the runtime's ``stop_timeout``).
            grace: Seconds allowed past the timeouts for the loop to finish the stop and for
                its thread to end (a loop stuck in foreign code costs ``4 * timeout + 2 *
                grace`` before the close fails the pending calls itself).

        Raises:
            DeviceOpError: a stream lane's threads did not end in time (they were abandoned
                and may still touch device memory); everything else was shut down.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread, actors = self._loop, self._thread, self._actors
        if loop is None or thread is None or actors is None:
            return
        t = self._stop_timeout if timeout is None else timeout
        stopping = actors.stop(timeout=t)
        stopped = asyncio.run_coroutine_threadsafe(stopping, loop)
        try:
            stopped.result(timeout=3 * t + grace)
        except Exception:  # the loop is stopped regardless; pending calls are failed below
            if stopped.cancel():  # never started (a stuck loop): it never will
                stopping.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=t + grace)
        closed = ActorClosedError("runtime closed before replying", actor="runtime")
        with self._lock:
            leftovers, self._outstanding = self._outstanding, {}
        # A copy: a call that read the old dict just before the swap may still add to it (its
        # send then fails: the actors stopped).
        for reply, msg in list(leftovers.items()):
            # Only a stop that did not finish leaves replies here: a transfer among them may
            # have been enqueued, so it is not "not served".
            reply.settle(
                TransferAbandonedError(
                    "the runtime closed before replying; the copy may still land",
                    transfer_id=msg.transfer_id,
                    device=actors.device,
                )
                if isinstance(msg, Transfer)
                else closed
            )
        if actors.lanes_abandoned:
            raise DeviceOpError(
                f"{actors.lanes_abandoned} stream lane(s) did not end within {t}s; their "
                "threads may still touch device memory (see DeviceStatistics.lanes_abandoned)",
                device=actors.device,
                op="close",
            )

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._loop else "idle")
        return f"<Runtime {self.backend.kind}:{self.device_index} {state}>"

    # ---- plumbing ------------------------------------------------------------------

    def _running(self) -> tuple[asyncio.AbstractEventLoop, DeviceActors]:
        if self._closed:
            raise ActorClosedError("runtime is closed", actor="runtime")
        if self._loop is None:
            self.start()
        loop, actors = self._loop, self._actors
        assert loop is not None
        assert actors is not None
        return loop, actors

    def _ask(
        self,
        pick: Callable[[DeviceActors], Callable[..., object]],
        msg: Any,
        operands: Any = None,
        timeout: float | None = None,
        stream_handle: int = 0,
        admitted: Call | None = None,
    ) -> Any:
        # Sent from the calling thread, which runs the turn itself when the actor is idle.
        # ``admitted``: the observed call of a plain call that took the mailbox after all.
        actors = self._actors
        if self._closed or self._loop is None or actors is None:
            actors = self._running()[1]
        t = self.default_timeout if timeout is None else timeout
        reply: Reply[Any] = Reply()
        self._outstanding[reply] = msg  # one dict operation: atomic, no lock (see close)
        observers = self._observers
        call = admitted
        if call is None and observers.active:
            call = Call(msg, operands, stream_handle)
        try:
            if call is not None and admitted is None:
                observers.started(call)  # admission: in mailbox order
            pick(actors)(msg, operands, reply=reply)
        except Exception as exc:
            reply.settle(exc)
        except BaseException as exc:
            # An interrupt in the turn this thread ran (the turn settled what it held): it
            # reaches the caller as itself, even when the reply was settled already.
            self._outstanding.pop(reply, None)
            if call is not None:
                observers.finished(call, None, exc)
            raise
        try:
            result = reply.wait(t, type(msg).__name__)
        except BaseException as exc:
            if call is not None:
                observers.finished(call, None, exc)
            raise
        finally:
            self._outstanding.pop(reply, None)
        if call is not None:
            observers.finished(call, result, None)
        return result

    def _record(self, handle: int, msg: RecordCompletion | RecordEvent) -> None:
        # Returns once the record is queued (mailbox order = call order per thread); waits
        # for mailbox space (on the loop) instead of dropping the record when it is full.
        # A borrowed stream (nonzero handle) is touched only here, inside the call: a marker
        # recorded on it now stands for the caller's work, and the record is published once
        # that marker and kvactors' earlier work on the stream completed.
        loop, actors = self._running()
        streams = actors.streams
        actor = streams.get(handle)
        marker = self.backend.record_marker(actor.stream) if handle else None
        try:
            streams.send(handle, msg, marker, actor=actor)
            return
        except MailboxFullError:
            actor = streams.get(handle)
        cf = asyncio.run_coroutine_threadsafe(actor.tell(msg, marker), loop)
        reply: Reply[None] = Reply()
        with self._lock:
            self._outstanding[reply] = msg
        cf.add_done_callback(lambda f: _settle_from(f, reply))
        try:
            reply.wait(self.default_timeout + _GRACE, type(msg).__name__)
        finally:
            with self._lock:
                self._outstanding.pop(reply, None)

    def _aask(
        self,
        pick: Callable[[DeviceActors], Callable[..., object]],
        msg: Any,
        operands: Any = None,
        timeout: float | None = None,
    ) -> Awaitable[Any]:
        # Queued from the calling thread (an event loop's: it never runs the turn itself).
        _, actors = self._running()
        t = self.default_timeout if timeout is None else timeout
        observers = self._observers
        call = Call(msg, operands, getattr(msg, "stream_handle", 0)) if observers.active else None
        reply: Reply[Any] = Reply(
            None if call is None else lambda exc, value: observers.finished(call, value, exc)
        )
        try:
            if call is not None:
                observers.started(call)  # admission: in mailbox order
            pick(actors)(msg, operands, reply=reply, timeout=t, here=False)
        except BaseException as exc:
            reply.settle(exc)
        return reply

    # ---- transfers -----------------------------------------------------------------

    def transfer(
        self,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        *,
        stream_handle: int = 0,
        complete: bool = True,
        timeout: float | None = None,
    ) -> TransferDone:
        """Gather or scatter per ``request``; returns once the device completed the copy, or
        with ``complete=False`` once the copies are enqueued in order on the stream.

        When the actors are idle the calling thread validates and launches the copy itself
        (see the module docstring; CPU work is complete when launched). With
        ``complete=False`` the runtime still owns the operands
        and fences still wait until the device completed; synchronize the stream (or take a
        fence) before reading or reusing the host chunks. A device failure after such a
        return is logged and counted in ``statistics().transfers_failed``, and the stream's
        next synchronize raises it.

        Raises ``TransferValidationError`` (a ``ValueError``) or ``OperandTypeError`` (a
        ``TypeError``) before any memory is touched, ``TransferFailedError`` if the copy failed.
        """
        t0 = _clock()
        tid = next(self._ids)
        admitted: Call | None = None
        # Rule 3 holds the tensors, not the caller's lists: see _operands (inlined here).
        if isinstance(paged, list):
            paged = (
                tuple(map(tuple, paged)) if paged and isinstance(paged[0], list) else tuple(paged)
            )
        if isinstance(objects, list):
            objects = tuple(objects)
        actors = self._actors
        if actors is not None and not self._closed:
            # The actors idle (or held by plain calls only): the plain call, no message and no
            # reply slot (see GatherActor.transfer_now); else the mailbox.
            wait = self.default_timeout if timeout is None else timeout
            if not self._observers.active:
                done = actors.gather.transfer_now(
                    tid, request, paged, objects, stream_handle, complete, wait
                )
            else:
                done, admitted = self._observed_now(
                    actors, tid, request, paged, objects, stream_handle, complete, wait
                )
        else:
            done = None
        if done is None:
            msg = Transfer(
                transfer_id=tid, request=request, stream_handle=stream_handle, complete=complete
            )
            done = self._ask(
                _gather, msg, TransferOperands(paged, objects), timeout, stream_handle, admitted
            )
        # The latency histogram, in line (see kvactors.runtime._latency).
        try:
            counts = self._latency.local.transfer
        except AttributeError:
            counts = self._latency.mine()
        seconds = _clock() - t0
        counts[_bucket(_BOUNDS, seconds)] += 1
        counts[-1] += seconds
        return done

    def transfer_latency(self) -> tuple[tuple[int, ...], float]:
        """The latency of the transfers that returned (not those that raised), from the call
        to its return: calls per bucket of
        :data:`~kvactors.runtime._latency.LATENCY_BOUNDS` (then +Inf, not cumulative) and
        their seconds, every calling thread's summed (kept without a lock or a Python call
        on the call's path)."""
        return self._latency.snapshot()

    def _observed_now(
        self,
        actors: DeviceActors,
        tid: int,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        stream_handle: int,
        complete: bool,
        wait: float,
    ) -> tuple[TransferDone | None, Call | None]:
        # A plain call with observers: admitted (``started``) in its gather turn, so that
        # admission order stays the turns' order; the call, if admitted, for the mailbox.
        msg = Transfer(
            transfer_id=tid, request=request, stream_handle=stream_handle, complete=complete
        )
        call = Call(msg, TransferOperands(paged, objects), stream_handle)
        observers = self._observers
        try:
            done = actors.gather.transfer_now(
                tid,
                request,
                paged,
                objects,
                stream_handle,
                complete,
                wait,
                functools.partial(observers.started, call),
            )
        except BaseException as exc:
            observers.finished(call, None, exc)  # (only a call that was admitted)
            raise
        if done is not None:
            observers.finished(call, done, None)
        return done, call if call.seq else None

    def atransfer(
        self,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        *,
        stream_handle: int = 0,
        complete: bool = True,
        timeout: float | None = None,
    ) -> Awaitable[TransferDone]:
        """Asyncio twin of :meth:`transfer`: submitted now, awaited later.

        Like every ``a*`` method it queues the message before returning, so calls made in
        program order reach the mailbox in that order (a fence issued after a store waits for
        it even if the store's future has not been awaited yet).
        """
        msg = Transfer(
            transfer_id=next(self._ids),
            request=request,
            stream_handle=stream_handle,
            complete=complete,
        )
        return self._aask(_gather, msg, _operands(paged, objects), timeout)

    def fence(self, block_ids: Iterable[int], *, timeout: float | None = None) -> Fenced:
        """Return once every transfer begun earlier on ``block_ids`` has completed."""
        result: Fenced = self._ask(_gather, Fence(block_ids=tuple(block_ids)), None, timeout)
        return result

    def afence(
        self, block_ids: Iterable[int], *, timeout: float | None = None
    ) -> Awaitable[Fenced]:
        """Asyncio twin of :meth:`fence` (submitted now)."""
        return self._aask(_gather, Fence(block_ids=tuple(block_ids)), None, timeout)

    def ping(self, seq: int = 0, *, timeout: float | None = None) -> Pong:
        """Round trip to the GatherActor: answered after every message queued before it."""
        result: Pong = self._ask(_gather, Ping(seq=seq), None, timeout)
        return result

    def aping(self, seq: int = 0, *, timeout: float | None = None) -> Awaitable[Pong]:
        """Asyncio twin of :meth:`ping` (submitted now)."""
        return self._aask(_gather, Ping(seq=seq), None, timeout)

    # ---- streams, completions, events ---------------------------------------------

    def synchronize(self, stream_handle: int = 0, *, timeout: float | None = None) -> Synced:
        """Barrier on a stream: returns once all work submitted to it earlier ran."""
        result: Synced = self._ask(_stream(stream_handle), Sync(), None, timeout, stream_handle)
        return result

    def record_completion(self, stream_handle: int, kind: str, payload: bytes) -> None:
        """Queue a completion record; it is drainable once all earlier work on the stream ran."""
        self._record(stream_handle, RecordCompletion(kind=kind, payload=bytes(payload)))

    def drain_completions(self) -> list[tuple[str, bytes]]:
        """Return and clear the published completion records, in submission order.

        Also after :meth:`close`: records published before or during the close stay
        drainable (a record the close could not publish is withdrawn and counted in
        :attr:`records_withdrawn`)."""
        return self._outboxes().completions.drain()

    def record_event(self, stream_handle: int, record: EventRecord) -> None:
        """Queue an event record; it is drainable once all earlier work on the stream ran."""
        self._record(stream_handle, RecordEvent(record=record))

    def drain_events(self) -> list[EventRecord]:
        """Return and clear the published event records, in submission order (also after
        :meth:`close`, like :meth:`drain_completions`)."""
        return self._outboxes().events.drain()

    @property
    def records_withdrawn(self) -> int:
        """Completion and event records never published: their stream failed, or the
        runtime closed before the stream ran that far. Every record is either drainable or
        counted here."""
        actors = self._actors
        if actors is None:
            return 0
        return actors.completions.withdrawn + actors.events.withdrawn

    def _outboxes(self) -> DeviceActors:
        actors = self._actors
        if actors is not None and (self._closed or self._loop is not None):
            return actors
        return self._running()[1]

    # ---- memory and IPC ------------------------------------------------------------

    def tensor_from_ptr(
        self,
        ptr: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        stride: Sequence[int] | None = None,
        storage_offset: int = 0,
    ) -> torch.Tensor:
        """A validated non-owning view of process-local memory (backend-specific rules)."""
        return self.backend.tensor_from_ptr(
            ptr,
            shape,
            dtype,
            index=self.device_index,
            stride=stride,
            storage_offset=storage_offset,
        )

    def open_ipc(
        self, handle: IPCHandle, *, context_id: int, timeout: float | None = None
    ) -> torch.Tensor:
        """Open an exported handle into ``context_id``; the view lives until the context closes."""
        opened: tuple[Opened, torch.Tensor] = self._ask(
            _ipc, OpenHandle(context_id=context_id, handle=handle), None, timeout
        )
        return opened[1]

    def close_ipc_context(
        self,
        context_id: int,
        *,
        stream_handles: Sequence[int] = (0,),
        timeout: float | None = None,
    ) -> ContextClosed:
        """Close every owner of the context (idempotent), after every transfer submitted
        before this call ran on the named streams.

        Ordered in two steps: a barrier through the GatherActor (answered in its turn, so
        every transfer it accepted before has handed its copies to a stream), then the IPC
        actor's close, which synchronizes ``stream_handles`` (and every stream that used the
        views), drops the views and closes the owners."""
        msg = CloseContext(context_id=context_id, stream_handles=tuple(stream_handles))
        self._ask(_gather, Ping(seq=context_id), None, timeout)
        result: ContextClosed = self._ask(_ipc, msg, None, timeout)
        return result

    # ---- observability -------------------------------------------------------------

    def add_observer(self, observer: RuntimeObserver) -> Callable[[], None]:
        """Report every call to ``observer`` from mailbox admission on; returns the detach.

        ``Runtime(observer=...)`` attaches one at construction. See :mod:`kvactors.observe`.
        """
        self._observers.add(observer)
        return lambda: self._observers.remove(observer)

    def statistics(self) -> DeviceStatistics:
        """A frozen snapshot of every actor of this runtime's device (read on the calling
        thread: it never waits for the loop)."""
        return self._outboxes().statistics()


def _operands(paged: Any, objects: Sequence[torch.Tensor]) -> TransferOperands:
    # Rule 3 holds the tensors, not the caller's lists: the structure is snapshotted at
    # submission (tuples), so a caller that clears its lists once the call returned cannot
    # free a chunk whose copy is still queued.
    if isinstance(paged, list):
        paged = tuple(map(tuple, paged)) if paged and isinstance(paged[0], list) else tuple(paged)
    return TransferOperands(paged, tuple(objects) if isinstance(objects, list) else objects)


def _settle_from(fut: concurrent.futures.Future[None], reply: Reply[None]) -> None:
    # ``reply`` as ``fut`` ended (a cancelled ``fut`` as a closed request).
    if fut.cancelled():
        reply.settle(ActorClosedError("request cancelled", actor="runtime"))
    elif (exc := fut.exception()) is not None:
        reply.settle(exc)
    else:
        reply.settle(None)


# A pick: how a call reaches its actor, ``send(msg, operands, *, reply)`` (a stream's through
# its directory, which hands a message an idle actor retired meanwhile refused to its handle's
# new actor).


def _gather(actors: DeviceActors) -> Callable[..., object]:
    return actors.gather.ask_nowait


def _ipc(actors: DeviceActors) -> Callable[..., object]:
    return actors.ipc.ask_nowait


def _stream(handle: int) -> Callable[[DeviceActors], Callable[..., object]]:
    def pick(actors: DeviceActors) -> Callable[..., object]:
        return functools.partial(actors.streams.send, handle)

    return pick


_runtimes: dict[tuple[str, int], Runtime] = {}
_runtimes_lock = threading.Lock()


def get_runtime(backend: str | Backend = "cpu", device_index: int = 0) -> Runtime:
    """The process-wide runtime for ``(backend kind, device_index)``, started on first use and
    closed at interpreter exit. A :class:`Backend` instance is used only when no runtime of its
    kind and index runs yet."""
    key = (backend if isinstance(backend, str) else backend.kind, device_index)
    with _runtimes_lock:
        rt = _runtimes.get(key)
        if rt is None or rt.closed:
            rt = Runtime(backend, device_index=device_index)
            _runtimes[key] = rt
    return rt.start()


@atexit.register
def _close_all() -> None:
    with _runtimes_lock:
        rts = list(_runtimes.values())
        _runtimes.clear()
    for rt in rts:
        with contextlib.suppress(DeviceOpError):  # abandoned lanes were logged; exit anyway
            rt.close(timeout=2.0)
