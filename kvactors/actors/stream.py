"""StreamActor: one device stream, its lane thread, and sync-then-publish.

Theory of operation. The actor's mailbox order is the stream order: every message becomes one
job on the stream's lane, submitted in the order the messages arrived, except a ``Launch``
whose turn runs on a sender's thread (not the loop's) while the lane has no job queued or
running: nothing is ahead of it, so that thread launches it itself (device work never runs on
the event loop). ``Launch`` puts device work on the stream and hands its lease to the reaper,
which answers only when the work's marker completed (rule 3, own until done); a launch whose
marker is already complete (CPU) answers at once, on the thread that launched it.
``RecordCompletion`` and ``RecordEvent`` reserve their slot
in the outbox at once (submission order) and put a marker on the stream behind every earlier
launch (a borrowed stream's caller marked it in its call); the reaper publishes once that
marker completed, so no record becomes drainable before every earlier piece of work on the
stream ran (rule 1, sync-then-publish), and the lane never waits for the device for it.
``Sync`` synchronizes the stream on the lane and replies.

A failure reported by the device is a failure: a launch that fails answers with
:class:`~kvactors.errors.TransferFailedError`; a record whose marker failed is withdrawn (never
published) and breaks the actor, since a stream with a sticky error cannot order anything.

Stopping lets the lane finish what is queued (bounded); a record whose publish job did not run
by then is withdrawn and counted (``Outbox.withdrawn``), so every record is either published
or failed, and none holds back the records behind it. ``on_idle`` (set by the directory) is
called on the loop whenever the actor holds nothing (from the base's ``went_idle`` hook),
which is when a borrowed-stream actor may be retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import msgspec

from kvactors.actors.actor import Actor, running_loop, take_route
from kvactors.actors.envelope import DEFERRED, Envelope, unreachable
from kvactors.actors.lane import Lane
from kvactors.core.protocols.stream import (
    EventRecord,
    Launch,
    Launched,
    RecordCompletion,
    RecordEvent,
    StreamRequest,
    Sync,
    Synced,
)
from kvactors.errors import (
    DeviceOpError,
    OperandTypeError,
    transfer_failed,
    translate,
)

if TYPE_CHECKING:
    from kvactors.actors.outbox import Outbox
    from kvactors.actors.reply import Reply
    from kvactors.devices.base import Backend, StreamLike

__all__ = ("StreamActor", "Work")

_log = logging.getLogger("kvactors.actors.stream")


@final
class Work(msgspec.Struct, eq=False):
    """The operand bundle of a :class:`Launch`: the device work ``fn`` and optionally
    ``on_enqueued``, called on the loop once the work is enqueued on the stream (before it
    completed; the Launch itself is answered at completion).

    ``fn`` is the lease: the lane keeps it until the work's marker completed, so whatever it
    references (the tensors it reads and writes) stays alive until then (rule 3). A closure
    that must own more than it touches references that too."""

    fn: Callable[[], None]
    on_enqueued: Callable[[], None] | None = None


class StreamActor(Actor[StreamRequest]):
    """Owns one stream (or a borrowed caller stream) and orders all work and records on it."""

    accepts = (Launch, RecordCompletion, RecordEvent, Sync)
    turns_anywhere = True

    def __init__(
        self,
        name: str,
        *,
        backend: Backend,
        index: int,
        stream: StreamLike,
        completions: Outbox[tuple[str, bytes]],
        events: Outbox[EventRecord],
        capacity: int = 1024,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(name, capacity=capacity)
        self.backend = backend
        self.index = index
        self.stream = stream
        self.lane = Lane(name, backend, index, stream)
        # Plain calls' route to this stream's turn (see launch_now).
        self._route = threading.Lock()
        self._completes = backend.completes_on_launch
        self._completions = completions
        self._events = events
        self._stop_timeout = stop_timeout
        self._device = f"{backend.kind}:{index}"
        self.sync_seconds = 0.0
        self.syncs = 0
        self.lanes_abandoned = 0
        self._records: set[tuple[Outbox[Any], int]] = set()
        #: Called on the loop when the actor holds nothing (see the module docstring).
        self._on_idle: Callable[[], None] | None = None
        self._noted = False

    def _synchronize(self) -> None:
        # Runs on the lane thread (the only writer of these counters).
        t0 = time.perf_counter()
        try:
            self.backend.synchronize(self.stream)
        finally:
            self.sync_seconds += time.perf_counter() - t0
            self.syncs += 1

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the lane threads, then the actor task."""
        self.lane.start()
        super().start(loop)

    async def on_stop(self, closed: Any) -> None:
        """Let the lane finish queued work (bounded), then end its threads; withdraw every
        record whose publish did not run."""
        try:
            if not await _off_loop(self.lane.stop, self._stop_timeout, f"stop:{self.name}"):
                # The threads stay alive as daemons and may still touch device memory: say so,
                # count it (DeviceStatistics.lanes_abandoned) and let Runtime.close() raise it.
                self.lanes_abandoned += 1
                _log.error(
                    "%s: lane threads did not end within %ss; abandoned",
                    self.name,
                    self._stop_timeout,
                    extra={"actor": self.name, "device": self._device},
                )
        finally:
            for outbox, seq in list(self._records):
                outbox.withdraw(seq)
            self._records.clear()

    async def retire(self, timeout: float | None) -> None:
        """Stop an actor the directory retired (it refuses every send already): the work
        it launched completes first, whatever it takes (retirement is housekeeping on a
        healthy device, never a reason to abandon a copy; ``Runtime.close`` bounds it), then
        the bounded stop of :meth:`stop`."""
        lane = self.lane
        if lane.watching:
            loop = asyncio.get_running_loop()
            dropped: asyncio.Future[bool] = loop.create_future()

            def reaped() -> None:  # on the reaper: every lease watched before was dropped
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                    loop.call_soon_threadsafe(_settle, dropped, True, None)

            lane.after_reaped(reaped)
            await dropped
        await self.stop(graceful=True, timeout=timeout)

    @property
    def idle_noted(self) -> bool:
        """Set by the directory while it lists this actor as idle: it need not be told again,
        so :meth:`went_idle` is not called meanwhile (a turn's end costs no call)."""
        return self._noted

    @idle_noted.setter
    def idle_noted(self, noted: bool) -> None:
        self._noted = noted
        self.hear_idle(self._on_idle is not None and not noted)

    @property
    def on_idle(self) -> Callable[[], None] | None:
        """Called on the loop when the actor holds nothing (see the module docstring)."""
        return self._on_idle

    @on_idle.setter
    def on_idle(self, hook: Callable[[], None] | None) -> None:
        self._on_idle = hook
        self.hear_idle(hook is not None and not self._noted)

    def went_idle(self) -> None:
        """Tell ``on_idle``, on the loop (scheduled there from another thread, unless the
        directory already noted this actor idle), if the actor still holds nothing then."""
        hook = self._on_idle
        if hook is None:
            return
        loop = self._loop
        if loop is not None and running_loop() is loop:  # on the loop (``on_loop``)
            if self.idle():
                hook()
        elif loop is not None and not self._noted:
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing to retire
                loop.call_soon_threadsafe(self.went_idle)

    def receive(self, env: Envelope[StreamRequest]) -> Any:
        """Turn the message into one lane job, in mailbox order."""
        msg = env.msg
        match msg:
            case Launch():
                return self._launch(env, msg)
            case RecordCompletion():
                self._record(env, self._completions, (msg.kind, msg.payload))
            case RecordEvent():
                self._record(env, self._events, msg.record)
            case Sync():
                self._sync(env)
            case _:
                unreachable(msg)
        return DEFERRED

    def _launch(self, env: Envelope[StreamRequest], msg: Launch) -> Any:
        # Every exit settles the reply: answered, failed, or left to the reaper once the
        # launch may have enqueued device work; an interrupt (KeyboardInterrupt, SystemExit)
        # then propagates as itself.
        work = env.operands
        if not isinstance(work, Work):
            raise OperandTypeError(
                f"Launch needs a Work operand bundle, got {type(work).__name__}", field="operands"
            )
        env.operands = None
        tid, nbytes, lane = msg.transfer_id, msg.nbytes, self.lane
        enqueued = work.on_enqueued
        work.on_enqueued = None
        loop = self.loop
        here = (loop is None or running_loop() is not loop) and lane.jobs_idle()
        if here and enqueued is None and self._completes and lane.reaper_idle():
            # The sender's thread, nothing ahead of it on the lane or the reaper, and work
            # that is complete once launched (CPU: its launch is the call itself): answered
            # in this turn, no reply deferred.
            try:
                work.fn()
            except BaseException as exc:
                self.count_failure()
                env.settle(transfer_failed(exc, tid, self._device))
                if isinstance(exc, Exception):
                    return DEFERRED
                raise
            return Launched(transfer_id=tid, nbytes=nbytes)
        job: _LaunchJob | None = None
        try:
            job = _LaunchJob(self, env, work, tid, nbytes, enqueued, here, self.defer(env))
            if here:
                job.run()  # the sender's thread: nothing queued on the lane is ahead of it
            else:
                lane.submit(job.run)
        except BaseException as exc:
            # A job never submitted, or one that will find its reply failed.
            if job is None:
                self.forget(env, transfer_failed(exc, tid, self._device))
            elif job.state is _Job.NEW and self.holds(env):
                job.done(exc)
            raise
        return DEFERRED

    def _put(
        self,
        fn: Callable[[], None],
        done: Callable[[BaseException | None], None],
        enqueued: Callable[[], None] | None = None,
        *,
        now: bool = False,
    ) -> Exception | None:
        # The one launch body, run by whoever holds this actor's turn with nothing on the
        # lane ahead of it (a plain call, a sender's thread, the lane): ``fn`` on the stream
        # and its lease (``fn``) to the reaper, which calls ``done(err)`` once the stream is
        # past it; ``enqueued()`` once it is on the stream. A launch that raised is returned:
        # what it enqueued before it failed (a kernel failing between two copies) still runs,
        # so the lease is kept and ``done(failure)`` called once the stream is past it. With
        # ``now``, a marker complete already while the reaper holds nothing earlier answers
        # here (its synchronize returns at once, and is where a stream error surfaces).
        backend, stream, lane = self.backend, self.stream, self.lane
        failure: Exception | None = None
        try:
            backend.launch(stream, fn)
        except Exception as exc:
            failure = exc
        marker = backend.record_marker(stream)
        if failure is not None:
            lane.watch(marker, fn, functools.partial(_reported, done, failure))
            return failure
        if enqueued is not None:
            enqueued()
        if now and marker.query() and lane.reaper_idle():
            err: BaseException | None = None
            try:
                marker.synchronize()
            except Exception as exc:
                err = exc
            done(err)
            return None
        lane.watch(marker, fn, done)
        return None

    def launch_now(
        self,
        tid: int,
        kernel: Callable[[], None],
        wait: float,
        enter: Callable[[], Reply[Any] | None],
        reaped: Callable[[BaseException | None], None],
    ) -> bool | None:
        """A plain call's stream turn (see :meth:`GatherActor.transfer_now
        <kvactors.actors.gather.GatherActor.transfer_now>`), run by the caller without a
        message: take this actor's route (waiting at most ``wait`` seconds: plain calls take
        it in their gather turn, so stream order is gather order), then its turn (shared where
        the launch is the copy: such copies run side by side), unless it is busy, anything is
        queued or its lane holds work to run (or, for a shared turn, to reap): then ``None``,
        nothing ran and nothing changed (the caller takes the mailbox). Then ``enter()`` (the
        caller's ledger entry; it returns what the copy waits for first, or None) and the
        launch of ``kernel``. True once launched: where the launch is the copy it ran (the
        caller ends the entry); else the reaper holds the lease (``kernel``) and calls
        ``reaped(err)`` once the stream is past it. From ``enter`` on, an exit by exception
        hands ``reaped(exc)`` the end of the entry, once the stream is past what the launch
        may have enqueued; a failed launch raises
        :class:`~kvactors.errors.TransferFailedError`, an interrupt itself."""
        route, completes = self._route, self._completes
        # What this call holds, each flag cleared on the line that ends it: on an exit by
        # exception the ``finally`` ends what is still held.
        on_route: bool | None = False
        claimed = launched = owns = False
        try:
            on_route = route.acquire(False) or take_route(route, self, wait)
            if not on_route:
                return None
            claimed = self.claim(shared=completes)
            lane = self.lane
            if not claimed or lane.jobs or (completes and lane.watching):
                return None
            owns = True
            after = enter()
            if completes:
                on_route = route.release()  # type: ignore[func-returns-value]  # None
                if after is not None:
                    after.wait(wait, "Transfer")  # the copies before it on its blocks ended
                launched = True
                kernel()  # the launch is the copy
                owns = claimed = self.end_turn()
                return True
            launched = True
            owns, failure = False, self._put(kernel, functools.partial(self._reaped, reaped))
            claimed = self.end_turn()
            on_route = route.release()  # type: ignore[func-returns-value]
            if failure is not None:
                raise failure  # the reaper ends the entry once the stream is past it
            return True
        except BaseException as exc:
            if owns:
                if launched:
                    self.count_failure()
                self._salvage(kernel, reaped, exc, launched and not completes)
            if launched and isinstance(exc, Exception):
                raise transfer_failed(exc, tid, self._device) from None
            raise
        finally:
            if claimed:
                self.end_turn(ran=launched)
            if on_route:
                route.release()

    def _reaped(
        self, then: Callable[[BaseException | None], None], err: BaseException | None
    ) -> None:
        # The reaper: a plain call's launch completed or failed (counted as this actor's).
        if err is not None:
            self.count_failure()
        then(err)

    def _salvage(
        self,
        work: object,
        done: Callable[[BaseException | None], None],
        exc: BaseException,
        maybe: bool,
    ) -> None:
        # A launch that ended early: fail it, once the stream is past whatever it may have
        # enqueued (the lease stays with the reaper until then).
        if maybe:
            try:
                marker = self.backend.record_marker(self.stream)
            except Exception:
                pass
            else:
                self.lane.watch(marker, work, lambda _err: done(exc))
                return
        done(exc)

    def _record(self, env: Envelope[StreamRequest], outbox: Outbox[Any], record: Any) -> None:
        # The slot is reserved now (submission order). A marker stands for everything before
        # the record on the stream: the caller's (a borrowed stream, marked in its call) or
        # one put on this stream behind every earlier launch (here, when the lane holds no
        # job and this is not the loop's thread; else by a lane job). The reaper publishes
        # once that marker completed and every earlier lease was dropped: nothing waits for
        # the device meanwhile. An interrupt before the marker was handed over withdraws the
        # slot (counted), so the records behind it are not held back.
        seq = -1
        queued = False
        try:
            seq = outbox.reserve()
            mine = (outbox, seq)
            self._records.add(mine)
            marker = env.operands  # a borrowed stream's marker, recorded in the caller's call
            env.operands = None
            settle = self.defer(env)
            lane, backend, stream = self.lane, self.backend, self.stream

            def reached(err: BaseException | None) -> None:
                if err is None:
                    outbox.publish(seq, record)
                    self._records.discard(mine)
                    settle(None, None)
                else:
                    outbox.withdraw(seq)
                    self._records.discard(mine)
                    settle(_sync_failed(err, self._device), None)

            def mark() -> bool:
                err: Exception | None = None
                try:
                    m = backend.record_marker(stream) if marker is None else marker
                    if not (self._completes and lane.reaper_idle()):
                        return lane.watch(m, None, reached)
                    # Work that completes once launched (CPU), no lease held: everything
                    # before ran. The synchronize returns at once; a stream error surfaces.
                    m.synchronize()
                except Exception as exc:
                    err = exc
                reached(err)
                return True

            loop = self.loop
            if lane.jobs_idle() and (loop is None or running_loop() is not loop):
                queued = mark()
            else:
                lane.submit(mark)
                queued = True
        except BaseException as exc:
            if not queued:
                if seq >= 0 and outbox.withdraw(seq):
                    self._records.discard((outbox, seq))
                self.forget(env, exc)
            raise

    def _sync(self, env: Envelope[StreamRequest]) -> None:
        lane = self.lane
        queued = False
        try:
            settle = self.defer(env)

            def sync() -> None:
                try:
                    self._synchronize()
                except BaseException as exc:
                    settle(_sync_failed(exc, self._device), None)
                    return
                # Answer from the reaper, so every lease of earlier work is dropped first:
                # whoever acts on the barrier (an IPC close) finds no host reference left.
                lane.after_reaped(lambda: settle(None, Synced(completed=lane.completed)))

            lane.submit(sync)
            queued = True
        except BaseException as exc:
            if not queued:
                self.forget(env, exc)
            raise


class _Job(enum.Enum):
    NEW = "new"  # not run: whoever gave up on it fails the reply
    RAN = "ran"  # run: it settles the reply on every exit
    LAUNCHING = "launching"  # the launch may have enqueued device work
    HANDED = "handed"  # the reply was settled, or the reaper holds the lease


class _LaunchJob:
    """The launch of one mailbox ``Launch``, on the sender's thread or the lane's."""

    __slots__ = ("actor", "enqueued", "env", "here", "nbytes", "settle", "state", "tid", "work")

    def __init__(
        self,
        actor: StreamActor,
        env: Envelope[StreamRequest],
        work: Work,
        tid: int,
        nbytes: int,
        enqueued: Callable[[], None] | None,
        here: bool,
        settle: Callable[[BaseException | None, Any], None],
    ) -> None:
        self.actor, self.env, self.work, self.tid, self.nbytes = actor, env, work, tid, nbytes
        self.enqueued, self.here, self.settle = enqueued, here, settle
        self.state = _Job.NEW

    def done(self, err: BaseException | None) -> None:
        if err is None:
            self.settle(None, Launched(transfer_id=self.tid, nbytes=self.nbytes))
        else:
            self.settle(transfer_failed(err, self.tid, self.actor._device), None)

    def run(self) -> None:
        actor, work = self.actor, self.work
        try:
            self.state = _Job.RAN
            if not actor.holds(self.env):
                return  # failed before it ran (an interrupted turn): never launched
            if not self.here and actor.lane.bind_error is not None:
                raise actor.lane.bind_error
            self.state = _Job.LAUNCHING
            actor._put(work.fn, self.done, self.enqueued, now=True)
            self.state = _Job.HANDED
        except BaseException as exc:
            if self.state is not _Job.HANDED:
                actor._salvage(work, self.done, exc, self.state is _Job.LAUNCHING)
            if not isinstance(exc, Exception):
                raise


def _reported(
    done: Callable[[BaseException | None], None], failure: BaseException, _err: object
) -> None:
    done(failure)  # a failed launch, reported once the stream is past what it enqueued


async def _off_loop(fn: Callable[[float], bool], arg: float, name: str) -> bool:
    # A thread of its own, not the loop's default executor: at interpreter exit (atexit
    # closes the runtimes) that executor refuses new work. Where no thread can start any
    # more, the loop's thread waits itself: nothing else runs on it then.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bool] = loop.create_future()

    def run() -> None:
        try:
            value = fn(arg)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, fut, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, fut, value, None)

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError:
        return fn(arg)
    return await fut


def _settle(fut: asyncio.Future[bool], value: bool | None, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(bool(value))


def _sync_failed(err: BaseException, device: str) -> BaseException:
    return translate(err, lambda m: DeviceOpError(m, device=device, op="synchronize"))
