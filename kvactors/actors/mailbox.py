"""The actor shell: a bounded FIFO mailbox, tell/ask with deadlines, lifecycle, statistics.

Theory of operation. An actor is one asyncio task that takes envelopes from a bounded
``asyncio.Queue`` in FIFO order and hands each to ``receive``. Mailbox order is the only
ordering an actor promises, and the actors built on this class derive their safety rules from
it. Sends are checked before anything is queued: a message outside the actor's protocol, a
full mailbox, a closed or a broken actor each raise at once, so nothing is half-sent.

Replies travel in the envelope's future, never in the message. ``receive`` may answer at once
(return a value) or take the reply over (return :data:`DEFERRED`) and settle it later, which is
how work handed to a lane thread gets answered when the device finished. An exception raised by
``receive`` for an ask fails that ask only; for a tell (nobody is waiting to hear about it) it
breaks the actor: every queued ask fails with :class:`ActorBrokenError` carrying the cause, and
so does every later send. Deadlines are timers on the loop that fail the reply future; the
message itself may still be processed, and its late answer is dropped.

Stopping refuses new sends, fails every queued ask with :class:`ActorClosedError`, lets the
subclass settle what it took over (``on_stop``), and ends the task. A graceful stop drains first.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, final

import msgspec

from kvactors.errors import (
    ActorBrokenError,
    ActorClosedError,
    DeadlineExceededError,
    MailboxFullError,
    UnknownMessageError,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ("DEFERRED", "Actor", "ActorState", "ActorStatistics", "Envelope")

M = TypeVar("M")


class _Deferred:
    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED: Final = _Deferred()
"""Returned by ``receive`` when the actor settles the reply itself later."""


class ActorState(enum.Enum):
    """Lifecycle of an actor."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    BROKEN = "broken"


class ActorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen snapshot of one actor's counters."""

    name: str
    state: str
    mailbox_depth: int
    mailbox_peak: int
    capacity: int
    processed: int
    failed: int
    deferred_pending: int


@final
class Envelope(Generic[M]):
    """A message, the operands riding beside it, and the reply future of an ask (else None)."""

    __slots__ = ("_timer", "msg", "operands", "reply")

    def __init__(self, msg: M, operands: Any, reply: asyncio.Future[Any] | None) -> None:
        self.msg = msg
        self.operands = operands
        self.reply = reply
        self._timer: asyncio.TimerHandle | None = None

    def resolve(self, value: Any) -> None:
        """Settle the reply with ``value`` (a no-op for tells and for expired asks)."""
        fut = self.reply
        if fut is not None and not fut.done():
            fut.set_result(value)
        self._cancel_timer()

    def fail(self, exc: BaseException) -> None:
        """Settle the reply with ``exc`` (a no-op for tells and for expired asks)."""
        fut = self.reply
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Actor(Generic[M]):
    """Base of every kvactors actor. Subclasses set ``accepts`` and implement ``receive``."""

    accepts: tuple[type, ...] = ()

    def __init__(self, name: str, *, capacity: int = 1024) -> None:
        if capacity <= 0:
            raise ValueError(f"mailbox capacity must be positive, got {capacity}")
        self.name = name
        self._capacity = capacity
        self._queue: asyncio.Queue[Envelope[M] | None] = asyncio.Queue(maxsize=capacity)
        self._state = ActorState.CREATED
        self._cause: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._peak = 0
        self._processed = 0
        self._failed = 0
        self._deferred: set[Envelope[M]] = set()
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- introspection -------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        """Current lifecycle state."""
        return self._state

    def statistics(self) -> ActorStatistics:
        """A frozen snapshot of this actor's counters."""
        return ActorStatistics(
            name=self.name,
            state=self._state.value,
            mailbox_depth=self._queue.qsize(),
            mailbox_peak=self._peak,
            capacity=self._capacity,
            processed=self._processed,
            failed=self._failed,
            deferred_pending=len(self._deferred),
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name} {self._state.name} "
            f"depth={self._queue.qsize()} deferred={len(self._deferred)}>"
        )

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the actor's task on the running loop."""
        if self._state is not ActorState.CREATED:
            raise ActorClosedError(f"cannot start from {self._state.value}", actor=self.name)
        self._loop = asyncio.get_running_loop()
        self._state = ActorState.RUNNING
        self._task = self._loop.create_task(self._run(), name=f"actor:{self.name}")

    async def drain(self) -> None:
        """Wait until every queued message was processed and every deferred reply settled."""
        while self._state is ActorState.RUNNING and (
            not self._queue.empty() or self._deferred or self._busy
        ):
            self._idle.clear()
            await self._idle.wait()

    async def stop(self, *, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: optionally drain first (bounded by ``timeout``), then fail whatever is left."""
        if self._state in (ActorState.STOPPED, ActorState.STOPPING):
            if self._task is not None:
                await asyncio.shield(self._task)
            return
        if graceful and self._state is ActorState.RUNNING:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.drain(), timeout)
        was_broken = self._state is ActorState.BROKEN
        self._state = ActorState.STOPPING
        closed = ActorClosedError("actor stopped before replying", actor=self.name)
        self._fail_queued(closed)
        try:
            await self.on_stop(closed)
        finally:
            for env in list(self._deferred):
                env.fail(closed)
            self._deferred.clear()
            task = self._task
            if task is not None and not task.done():
                self._queue.put_nowait(None)
                try:
                    await asyncio.wait_for(asyncio.shield(task), timeout)
                except asyncio.TimeoutError:
                    task.cancel()
            self._state = ActorState.BROKEN if was_broken else ActorState.STOPPED
            self._idle.set()

    async def on_stop(self, closed: ActorClosedError) -> None:
        """Hook: settle (complete or fail) everything the subclass took over. Bounded."""

    # ---- sending -------------------------------------------------------------------

    def _check_send(self, msg: object) -> None:
        if self._state is not ActorState.RUNNING:
            if self._state is ActorState.BROKEN:
                raise ActorBrokenError("actor is broken", actor=self.name, cause=self._cause)
            raise ActorClosedError(f"actor is {self._state.value}", actor=self.name)
        if not isinstance(msg, self.accepts):
            raise UnknownMessageError(actor=self.name, message_type=type(msg).__name__)

    def _enqueue(self, env: Envelope[M]) -> None:
        try:
            self._queue.put_nowait(env)
        except asyncio.QueueFull:
            raise MailboxFullError(actor=self.name, capacity=self._capacity) from None
        depth = self._queue.qsize()
        if depth > self._peak:
            self._peak = depth

    def tell_nowait(self, msg: M, operands: Any = None) -> None:
        """Queue ``msg`` without waiting for a reply; raise at once if it cannot be queued."""
        self._check_send(msg)
        self._enqueue(Envelope(msg, operands, None))

    async def tell(self, msg: M, operands: Any = None) -> None:
        """Queue ``msg``, waiting for mailbox space (backpressure) instead of failing."""
        self._check_send(msg)
        await self._queue.put(Envelope(msg, operands, None))

    def ask_nowait(
        self, msg: M, operands: Any = None, *, timeout: float | None = None
    ) -> asyncio.Future[Any]:
        """Queue ``msg`` and return its reply future, failed past ``timeout`` seconds."""
        self._check_send(msg)
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[Any] = loop.create_future()
        env: Envelope[M] = Envelope(msg, operands, fut)
        self._enqueue(env)
        if timeout is not None:
            env._timer = loop.call_later(timeout, _expire, fut, self.name, msg, timeout)
        return fut

    async def ask(self, msg: M, operands: Any = None, *, timeout: float | None = None) -> Any:
        """Send ``msg`` and wait for its reply (at most ``timeout`` seconds)."""
        return await self.ask_nowait(msg, operands, timeout=timeout)

    # ---- receiving -----------------------------------------------------------------

    async def receive(self, env: Envelope[M]) -> Any:
        """Handle one envelope. Return the reply, or :data:`DEFERRED` and settle it later."""
        raise NotImplementedError

    def defer(self, env: Envelope[M]) -> Callable[[BaseException | None, Any], None]:
        """Take over ``env``'s reply; the returned callable settles it (exc, value)."""
        self._deferred.add(env)

        def settle(exc: BaseException | None, value: Any = None) -> None:
            if env not in self._deferred:
                return
            self._deferred.discard(env)
            if exc is None:
                env.resolve(value)
            else:
                self._failed += 1
                env.fail(exc)
                if env.reply is None:
                    self.break_with(exc)
            if not self._deferred and self._queue.empty():
                self._idle.set()

        return settle

    def break_with(self, cause: BaseException) -> None:
        """Mark the actor broken: queued and later sends fail with ``ActorBrokenError``."""
        if self._state is not ActorState.RUNNING:
            return
        self._state = ActorState.BROKEN
        self._cause = cause
        broken = ActorBrokenError("actor broke", actor=self.name, cause=cause)
        self._fail_queued(broken)
        for env in list(self._deferred):
            env.fail(broken)
        self._idle.set()

    def _fail_queued(self, exc: BaseException) -> None:
        while True:
            try:
                env = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            if env is not None:
                env.fail(exc)

    async def _run(self) -> None:
        queue = self._queue
        while True:
            env = await queue.get()
            if env is None:
                return
            self._busy = True
            if self._state is not ActorState.RUNNING:
                env.fail(
                    ActorBrokenError("actor is broken", actor=self.name, cause=self._cause)
                    if self._state is ActorState.BROKEN
                    else ActorClosedError("actor stopped", actor=self.name)
                )
                del env
                self._busy = False
                continue
            try:
                result = await self.receive(env)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed += 1
                if env.reply is None:
                    self.break_with(exc)
                else:
                    env.fail(exc)
            else:
                if result is not DEFERRED:
                    env.resolve(result)
                del result
            # Drop the envelope now: an idle actor must not keep the last reply (and any
            # tensors riding beside it) alive while it waits for the next message.
            del env
            self._processed += 1
            self._busy = False
            if queue.empty() and not self._deferred:
                self._idle.set()


def _expire(fut: asyncio.Future[Any], actor: str, msg: object, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(
            DeadlineExceededError(actor=actor, message_type=type(msg).__name__, timeout=timeout)
        )
