"""The actor shell: a bounded FIFO mailbox, tell/ask with deadlines, lifecycle, statistics.

Theory of operation. An actor lives on one event loop and handles one envelope at a time, in
FIFO order; mailbox order is the only ordering an actor promises, and the actors built on
this class derive their safety rules from it. ``receive`` is synchronous and short: it
answers at once (returns a value) or takes the reply over (returns :data:`DEFERRED`) and
settles it later, which is how work handed to a lane thread gets answered when the device
finished. Because handlers never await, an idle actor handles a message directly in the
sender's turn of the loop (no task switch, no extra loop iteration); a message that arrives
while the actor is busy (a handler sent to its own actor, directly or through a settle
callback) waits in the FIFO and is handled by the actor's task in order, so FIFO holds
either way.

The bound counts what the actor holds: envelopes queued plus replies it took over and has
not settled yet (work in flight). A send past the bound raises
:class:`~kvactors.errors.MailboxFullError` (``tell_nowait``/``ask_nowait``) or waits for space
(``tell``); nothing is dropped. Sends are checked before anything is queued: a message outside
the actor's protocol, a full mailbox, a closed or a broken actor each raise at once.

Replies travel in the envelope's reply slot, never in the message: an ``asyncio.Future`` for
asyncio callers, or any object with the same ``done``/``set_result``/``set_exception`` methods
(the runtime's foreign-thread reply slot). An exception raised by ``receive`` for an ask fails
that ask only; for a tell (nobody is waiting to hear about it) it breaks the actor: every
queued ask fails with :class:`ActorBrokenError` carrying the cause, and so does every later
send. Deadlines are timers on the loop that fail the reply; the message may still be handled,
and its late answer is dropped.

Stopping refuses new sends, fails every queued ask with :class:`ActorClosedError`, lets the
subclass settle what it took over (``on_stop``), and ends the task. A graceful stop drains first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, NoReturn, Protocol, TypeVar, final

import msgspec

from kvactors.errors import (
    ActorBrokenError,
    ActorClosedError,
    DeadlineExceededError,
    InvalidSettingError,
    MailboxFullError,
    UnknownMessageError,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = (
    "DEFERRED",
    "Actor",
    "ActorState",
    "ActorStatistics",
    "Envelope",
    "ReplySlot",
    "unreachable",
)

M = TypeVar("M")


class _Deferred:
    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED: Final = _Deferred()
"""Returned by ``receive`` when the actor settles the reply itself later."""


def unreachable(msg: NoReturn) -> NoReturn:
    """The ``case _`` of an exhaustive ``match`` on a protocol union: a message type added to
    the union but not handled fails the type check here, and at run time raises."""
    raise AssertionError(f"unhandled message {type(msg).__name__}")


class ReplySlot(Protocol):
    """Where an ask's reply goes: an ``asyncio.Future`` or anything shaped like one."""

    def done(self) -> bool:
        """Whether the reply was already settled."""
        ...

    def set_result(self, value: Any, /) -> None:
        """Settle with a value."""
        ...

    def set_exception(self, exc: BaseException, /) -> None:
        """Settle with an exception."""
        ...


class ActorState(enum.Enum):
    """Lifecycle of an actor."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    BROKEN = "broken"


class ActorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen snapshot of one actor's counters.

    ``mailbox_depth`` counts envelopes waiting; ``deferred_pending`` replies taken over and not
    yet settled; both count against ``capacity``, and ``mailbox_peak`` is their highest sum.
    """

    name: str
    state: Literal["created", "running", "stopping", "stopped", "broken"]
    """The :class:`ActorState` value."""
    mailbox_depth: int
    mailbox_peak: int
    capacity: int
    processed: int
    failed: int
    deferred_pending: int


@final
class Envelope(Generic[M]):
    """A message, the operands riding beside it, and the reply slot of an ask (else None)."""

    __slots__ = ("_timer", "msg", "operands", "reply")

    def __init__(self, msg: M, operands: Any, reply: ReplySlot | None) -> None:
        self.msg = msg
        self.operands = operands
        self.reply = reply
        self._timer: asyncio.TimerHandle | None = None

    def resolve(self, value: Any) -> None:
        """Settle the reply with ``value`` (a no-op for tells and for expired asks)."""
        slot = self.reply
        if slot is not None and not slot.done():
            slot.set_result(value)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def fail(self, exc: BaseException) -> None:
        """Settle the reply with ``exc`` (a no-op for tells and for expired asks)."""
        slot = self.reply
        if slot is not None and not slot.done():
            slot.set_exception(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Actor(Generic[M]):
    """Base of every kvactors actor. Subclasses set ``accepts`` and implement ``receive``."""

    accepts: tuple[type, ...] = ()

    def __init__(self, name: str, *, capacity: int = 1024) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"mailbox capacity must be positive, got {capacity}", setting="capacity"
            )
        self.name = name
        self._capacity = capacity
        self._fifo: collections.deque[Envelope[M]] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._space: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._state = ActorState.CREATED
        self._cause: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy = False
        self._peak = 0
        self._processed = 0
        self._failed = 0
        self._deferred: set[Envelope[M]] = set()

    # ---- introspection -------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        """Current lifecycle state."""
        return self._state

    @property
    def queued(self) -> int:
        """Envelopes waiting in the FIFO (a length read, safe from any thread)."""
        return len(self._fifo) if self._state is ActorState.RUNNING else -1

    @property
    def pending(self) -> int:
        """Envelopes queued plus replies taken over and not settled (counted by the bound)."""
        return len(self._fifo) + len(self._deferred)

    def statistics(self) -> ActorStatistics:
        """A frozen snapshot of this actor's counters."""
        return ActorStatistics(
            name=self.name,
            state=self._state.value,
            mailbox_depth=len(self._fifo),
            mailbox_peak=self._peak,
            capacity=self._capacity,
            processed=self._processed,
            failed=self._failed,
            deferred_pending=len(self._deferred),
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name} {self._state.name} "
            f"depth={len(self._fifo)} deferred={len(self._deferred)}>"
        )

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the actor on the running loop."""
        if self._state is not ActorState.CREATED:
            raise ActorClosedError(f"cannot start from {self._state.value}", actor=self.name)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._state = ActorState.RUNNING
        self._task = self._loop.create_task(self._run(), name=f"actor:{self.name}")

    async def drain(self) -> None:
        """Wait until every queued message was handled and every deferred reply settled."""
        idle = self._idle
        while idle is not None and self._state is ActorState.RUNNING and self.pending:
            idle.clear()
            await idle.wait()

    async def stop(self, *, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: optionally drain first (bounded by ``timeout``), then fail whatever is left."""
        if self._state in (ActorState.STOPPED, ActorState.STOPPING, ActorState.CREATED):
            if self._state is ActorState.CREATED:
                self._state = ActorState.STOPPED
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
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._state = ActorState.BROKEN if was_broken else ActorState.STOPPED
            self._signal()

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
        if len(self._fifo) + len(self._deferred) >= self._capacity:
            raise MailboxFullError(actor=self.name, capacity=self._capacity)

    def _deliver(self, env: Envelope[M]) -> None:
        depth = len(self._fifo) + len(self._deferred) + 1
        if depth > self._peak:
            self._peak = depth
        if self._busy or self._fifo:
            self._fifo.append(env)
            assert self._wake is not None
            self._wake.set()
        else:
            self._dispatch(env)

    def tell_nowait(self, msg: M, operands: Any = None) -> None:
        """Send ``msg`` without waiting for a reply; raise at once if it cannot be queued."""
        self._check_send(msg)
        self._deliver(Envelope(msg, operands, None))

    async def tell(self, msg: M, operands: Any = None) -> None:
        """Send ``msg``, waiting for mailbox space (backpressure) instead of failing."""
        while True:
            try:
                self._check_send(msg)
            except MailboxFullError:
                assert self._space is not None
                self._space.clear()
                await self._space.wait()
                continue
            self._deliver(Envelope(msg, operands, None))
            return

    def ask_nowait(
        self, msg: M, operands: Any = None, *, timeout: float | None = None
    ) -> asyncio.Future[Any]:
        """Send ``msg`` and return its reply future, failed past ``timeout`` seconds."""
        loop = self._loop
        if loop is None:
            raise ActorClosedError("actor was never started", actor=self.name)
        fut: asyncio.Future[Any] = loop.create_future()
        self.ask_into(fut, msg, operands, timeout=timeout)
        return fut

    def ask_into(
        self, slot: ReplySlot, msg: M, operands: Any = None, *, timeout: float | None = None
    ) -> None:
        """Send ``msg`` with ``slot`` as its reply slot (call on the actor's loop)."""
        self._check_send(msg)
        env: Envelope[M] = Envelope(msg, operands, slot)
        if timeout is not None:
            assert self._loop is not None
            env._timer = self._loop.call_later(timeout, _expire, slot, self.name, msg, timeout)
        self._deliver(env)

    # ---- receiving -----------------------------------------------------------------

    def receive(self, env: Envelope[M]) -> Any:
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
            self._signal()

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
        self._deferred.clear()
        self._signal()

    def _fail_queued(self, exc: BaseException) -> None:
        while self._fifo:
            self._fifo.popleft().fail(exc)

    def _signal(self) -> None:
        pending = len(self._fifo) + len(self._deferred)
        if self._space is not None and pending < self._capacity:
            self._space.set()
        if self._idle is not None and (pending == 0 or self._state is not ActorState.RUNNING):
            self._idle.set()

    def _dispatch(self, env: Envelope[M]) -> None:
        self._busy = True
        try:
            result = self.receive(env)
        except Exception as exc:
            self._failed += 1
            if env.reply is None:
                self.break_with(exc)
            else:
                env.fail(exc)
        else:
            if result is not DEFERRED:
                env.resolve(result)
        finally:
            self._busy = False
            self._processed += 1
        self._signal()

    async def _run(self) -> None:
        # Handles what arrived while the actor was busy, in FIFO order.
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            while self._fifo and not self._busy:
                env = self._fifo.popleft()
                if self._state is not ActorState.RUNNING:
                    env.fail(
                        ActorBrokenError("actor is broken", actor=self.name, cause=self._cause)
                        if self._state is ActorState.BROKEN
                        else ActorClosedError("actor stopped", actor=self.name)
                    )
                else:
                    self._dispatch(env)
                # Drop the envelope now: an idle actor must not keep the last reply (and
                # any tensors riding beside it) alive while it waits.
                del env


def _expire(slot: ReplySlot, actor: str, msg: object, timeout: float) -> None:
    if not slot.done():
        slot.set_exception(
            DeadlineExceededError(actor=actor, message_type=type(msg).__name__, timeout=timeout)
        )
