"""The actor shell: a bounded FIFO mailbox, tell/ask with deadlines, turns, lifecycle, statistics.

An actor handles one envelope at a time, in FIFO order (its *turn*); mailbox order is the only
ordering an actor promises, and the actors built on it derive their safety rules from it.
``receive`` is synchronous and short: it returns the reply, or takes the reply over
(:meth:`Actor.defer`, returns :data:`DEFERRED`) and settles it later from any thread. Every
reply is a :class:`~kvactors.actors.reply.Reply`: the first settle wins.

Who runs a turn: every transition under the actor's lock, and the turn's transitions are the
table :data:`TURNS` that the code reads (a transition it does not list does not happen: a
claim is refused, a send queues). The turn (:class:`Turn`, with the count of shared holds),
the FIFO and the lifecycle state are all there is:

=======  ==========================================================  ========================
turn     event (:class:`TurnEvent`)                                  next
=======  ==========================================================  ========================
IDLE     CLAIM: :meth:`Actor.claim`, a plain call (no envelope)      TURN until end_turn
IDLE     SEND: a send, not from inside a turn, from a thread that    TURN: the sender runs it
         may run turns (the loop's, or any when ``turns_anywhere``)  now
IDLE,    CLAIM_SHARED: ``claim(shared=True)``, a plain call whose    SHARED n+1 until its
SHARED   work may run beside others' (CPU copies)                    end_turn
IDLE     RUN: the task's loop runs the FIFO head                     TURN (on the loop)
TURN     END: the turn ends (an interrupt ends it too)               IDLE; the task is woken
                                                                     if anything is queued
SHARED   END: a shared hold ends, not the last                       SHARED n-1
SHARED   END_LAST: the last shared hold ends                         IDLE; the task is woken
                                                                     if anything is queued
=======  ==========================================================  ========================

Besides the table: a claim and a running send also need an empty FIFO (a plain call never
overtakes a queued message), a running actor and room; any other send (``here=False``: an
``a*`` call; a send from inside a turn; a foreign thread of a loop-only actor) queues, and
the task is woken if the turn is IDLE. A stop or ``break_with`` fails the queued asks and
refuses later sends, whatever the turn.

An exception from ``receive`` fails its ask (a tell's breaks the actor); an interrupt
(``KeyboardInterrupt``, ``SystemExit``) fails the reply unless the subclass took it over
(``forget``), then reaches the thread's caller as itself. The bound counts envelopes queued
plus replies taken over: past it a send raises :class:`~kvactors.errors.MailboxFullError`
(``tell`` waits for space). A stop drains (if graceful), refuses sends, fails the FIFO, lets
the subclass settle what it took over (``on_stop``). Subclasses override hooks only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, Literal, TypeVar

import msgspec

from kvactors.actors.envelope import DEFERRED, Envelope
from kvactors.actors.reply import Reply, running_loop
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
    "TURNS",
    "Actor",
    "ActorState",
    "ActorStatistics",
    "Turn",
    "TurnEvent",
    "on_loop",
    "running_loop",
    "take_route",
)

M = TypeVar("M")
_SLICE = 0.05  # how soon a plain call waiting for its route sees the actor stop


class _Turns(threading.local):
    # Per thread: whether it runs a turn now (a send from inside a turn queues).
    inside = False


_turns = _Turns()


def on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the calling thread is running ``loop``."""
    return loop is not None and running_loop() is loop


def take_route(route: threading.Lock, actor: Actor[Any], wait: float) -> bool:
    """Wait for a plain call's *route* to ``actor``'s turn (a lock the plain call before holds
    for that turn), at most ``wait`` seconds; False at once once the actor stops (the call then
    takes the mailbox, which refuses it)."""
    end = time.monotonic() + wait
    while actor.state is ActorState.RUNNING:
        left = end - time.monotonic()
        if left <= 0:
            return False
        if route.acquire(timeout=min(left, _SLICE)):
            return True
    return False


class Turn(str, enum.Enum):
    """Who holds an actor's turn (the FIFO and the lifecycle state are kept beside it)."""

    IDLE = "idle"
    TURN = "turn"
    """One turn: a claim, or a send's turn on the sender's thread or the loop's."""
    SHARED = "shared"
    """Shared holds (``claim(shared=True)``), counted beside the turn."""


class TurnEvent(str, enum.Enum):
    """What may change an actor's :class:`Turn` (see :data:`TURNS`)."""

    CLAIM = "claim"
    CLAIM_SHARED = "claim_shared"
    SEND = "send"
    RUN = "run"
    END = "end"
    END_LAST = "end_last"
    """The last shared hold ends (only shared holds are counted)."""


TURNS: Final[dict[tuple[Turn, TurnEvent], Turn]] = {
    (Turn.IDLE, TurnEvent.CLAIM): Turn.TURN,
    (Turn.IDLE, TurnEvent.SEND): Turn.TURN,
    (Turn.IDLE, TurnEvent.CLAIM_SHARED): Turn.SHARED,
    (Turn.SHARED, TurnEvent.CLAIM_SHARED): Turn.SHARED,
    (Turn.IDLE, TurnEvent.RUN): Turn.TURN,
    (Turn.TURN, TurnEvent.END): Turn.IDLE,
    (Turn.SHARED, TurnEvent.END): Turn.SHARED,
    (Turn.SHARED, TurnEvent.END_LAST): Turn.IDLE,
}
"""The turn table (see the module docstring), read by every transition: ``(turn, event) ->
next``. An event a turn does not list changes nothing (a claim is refused, a send queues)."""

_IDLE, _SHARED = Turn.IDLE, Turn.SHARED
_CLAIM, _CLAIM_SHARED, _SEND, _RUN, _END, _END_LAST = (
    TurnEvent.CLAIM,
    TurnEvent.CLAIM_SHARED,
    TurnEvent.SEND,
    TurnEvent.RUN,
    TurnEvent.END,
    TurnEvent.END_LAST,
)


class ActorState(enum.Enum):
    """Lifecycle of an actor."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    BROKEN = "broken"


class ActorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen snapshot of one actor's counters. ``mailbox_depth`` (envelopes waiting) and
    ``deferred_pending`` (replies taken over) count against ``capacity``; ``mailbox_peak``
    is their highest sum."""

    name: str
    state: Literal["created", "running", "stopping", "stopped", "broken"]
    """The :class:`ActorState` value."""
    mailbox_depth: int
    mailbox_peak: int
    capacity: int
    processed: int
    failed: int
    deferred_pending: int


class Actor(Generic[M]):
    """Base of every kvactors actor. Subclasses set ``accepts`` and implement ``receive``."""

    accepts: tuple[type, ...] = ()
    turns_anywhere: ClassVar[bool] = False
    """Whether a sender on any thread may run an idle actor's turn itself (the subclass's
    handlers are thread-safe and touch no loop state); else only the loop's thread does."""

    def __init__(self, name: str, *, capacity: int = 1024) -> None:
        if capacity <= 0:
            raise InvalidSettingError(
                f"mailbox capacity must be positive, got {capacity}", setting="capacity"
            )
        self.name = name
        self._capacity = capacity
        self._mutex = threading.Lock()  # the FIFO, the turn, the deferred set, the state
        self._fifo: collections.deque[Envelope[M]] = collections.deque()
        self._wake = asyncio.Event()  # the task's: something queued for it
        self._changed = asyncio.Event()  # what the actor holds changed
        self._watched = False  # the loop waits on ``_changed``: a change must wake it
        self._state = ActorState.CREATED
        self._cause: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn = _IDLE  # see TURNS
        self._holds = 0  # shared holds (while the turn is SHARED)
        self._tells_idle = False  # whether went_idle is called (hear_idle)
        self._peak = self._processed = self._failed = 0
        self._deferred: set[Envelope[M]] = set()

    # ---- introspection -------------------------------------------------------------

    @property
    def state(self) -> ActorState:
        """Current lifecycle state."""
        return self._state

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the actor was started on (None before :meth:`start`)."""
        return self._loop

    @property
    def turn(self) -> Turn:
        """Who holds the turn now (see :data:`TURNS`)."""
        return self._turn

    def idle(self) -> bool:
        """Whether the actor runs and holds nothing: no turn, no envelope, no reply."""
        return (
            self._state is ActorState.RUNNING
            and self._turn is _IDLE
            and not (self._fifo or self._deferred)
        )

    def count_failure(self) -> None:
        """Count a reply the subclass failed itself (in ``statistics().failed``)."""
        with self._mutex:
            self._failed += 1

    @property
    def pending(self) -> int:
        """Envelopes queued plus replies taken over and not settled (counted by the bound)."""
        return len(self._fifo) + len(self._deferred)

    def statistics(self) -> ActorStatistics:
        """A frozen snapshot of this actor's counters."""
        with self._mutex:
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
        return f"<{type(self).__name__} {self.name} {self._state.name} pending={self.pending}>"

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the actor on ``loop`` (default: the running loop; any thread may start it)."""
        if self._state is not ActorState.CREATED:
            raise ActorClosedError(f"cannot start from {self._state.value}", actor=self.name)
        self._loop = loop = asyncio.get_running_loop() if loop is None else loop
        self._state = ActorState.RUNNING
        if on_loop(loop):
            self._spawn()
        else:
            loop.call_soon_threadsafe(self._spawn)

    def _spawn(self) -> None:
        if self._task is None and self._loop is not None:
            self._task = self._loop.create_task(self._run(), name=f"actor:{self.name}")

    async def drain(self) -> None:
        """Wait until every queued message was handled and every deferred reply settled."""
        await self._until(lambda: self._state is not ActorState.RUNNING or not self.pending)

    async def _until(self, ready: Callable[[], bool]) -> None:
        # On the loop: sleep until ``ready()``, checked again whenever what it holds changed.
        while True:
            self._watched = True  # before the check: a change after it wakes the loop
            if ready():
                return
            self._changed.clear()
            await self._changed.wait()

    def close_if_idle(self) -> bool:
        """Refuse every later send if the actor holds nothing now (atomic with sends); the
        caller then stops it. ``False`` (nothing changed) if it holds anything."""
        with self._mutex:
            if self._state is not ActorState.RUNNING or self._turn is not _IDLE or self.pending:
                return False
            self._state = ActorState.STOPPING
            return True

    async def stop(self, *, graceful: bool = True, timeout: float | None = None) -> None:
        """Stop: optionally drain first (bounded by ``timeout``), then fail whatever is left."""
        state = self._state
        if state is ActorState.CREATED or state is ActorState.STOPPED:
            self._state = ActorState.STOPPED
            return
        if state is ActorState.STOPPING and self._task is None:  # a stop in progress
            return
        if graceful and self._state is ActorState.RUNNING:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.drain(), timeout)
        with self._mutex:
            was_broken = self._state is ActorState.BROKEN
            self._state = ActorState.STOPPING
            queued = list(self._fifo)
            self._fifo.clear()
        closed = ActorClosedError("actor stopped before replying", actor=self.name)
        for env in queued:
            env.settle(closed)
        task, self._task = self._task, None
        try:
            await self.on_stop(closed)
        finally:
            with self._mutex:
                left = list(self._deferred)
                self._deferred.clear()
            for env in left:
                env.settle(closed)
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._state = ActorState.BROKEN if was_broken else ActorState.STOPPED
            self._signal()

    # ---- hooks ---------------------------------------------------------------------

    def receive(self, env: Envelope[M]) -> Any:
        """Hook: handle one envelope. Return the reply, or :data:`DEFERRED` and settle it
        later (:meth:`defer`)."""
        raise NotImplementedError

    async def on_stop(self, closed: ActorClosedError) -> None:
        """Hook: settle (complete or fail) everything the subclass took over. Bounded."""

    def went_idle(self) -> None:
        """Hook: the actor holds nothing now (no turn, envelope or reply); called while
        :meth:`hear_idle` is on (off by default), on the thread that saw it: keep it short."""

    def hear_idle(self, on: bool) -> None:
        """Whether this actor's :meth:`went_idle` is called."""
        self._tells_idle = on

    # ---- sending -------------------------------------------------------------------

    def _deliver(self, env: Envelope[M], msg: object, *, here: bool = True) -> None:
        # Claim the turn if the actor is idle and this thread may run it; else queue (a busy
        # actor's turn, when it ends, wakes the task: no wake-up needed then).
        with self._mutex:
            depth = len(self._fifo) + len(self._deferred) + 1
            if self._state is not ActorState.RUNNING:
                raise self._refusal()
            if not isinstance(msg, self.accepts):
                raise UnknownMessageError(actor=self.name, message_type=type(msg).__name__)
            if depth > self._capacity:
                raise MailboxFullError(actor=self.name, capacity=self._capacity)
            self._peak = max(self._peak, depth)
            turn = self._turn
            nxt = TURNS.get((turn, _SEND))
            if (
                here
                and nxt is not None
                and not self._fifo
                and not _turns.inside
                and (self.turns_anywhere or on_loop(self._loop))
            ):
                self._turn = nxt
            else:
                self._fifo.append(env)
                here = False
        if here:
            self._run_turn(env)
        elif turn is _IDLE:
            self._on_loop(self._wake.set)

    def claim(self, *, shared: bool = False) -> bool:
        """Take an idle actor's turn for a plain call, run by the claimer without an
        envelope until :meth:`end_turn` (``False``, nothing changed, if the actor is busy, has
        anything queued, does not run or has no room). A ``shared`` claim is also taken beside
        other shared ones (work that may overlap), never beside a turn or a queued send."""
        with self._mutex:
            nxt = TURNS.get((self._turn, _CLAIM_SHARED if shared else _CLAIM))
            if (
                nxt is None
                or self._fifo
                or self._state is not ActorState.RUNNING
                or len(self._deferred) >= self._capacity
            ):
                return False
            self._turn = nxt
            self._holds += shared
            return True

    def end_turn(self, *, ran: bool = True) -> Literal[False]:
        """End a :meth:`claim` (processed unless ``ran`` is false); once none is held, the
        task runs what queued meanwhile. Returns False: ``claimed = actor.end_turn()``."""
        with self._mutex:
            turn, event = self._turn, _END
            if turn is _SHARED:
                self._holds -= 1
                if not self._holds:
                    event = _END_LAST
            nxt = TURNS.get((turn, event), turn)
            self._turn = nxt
            self._processed += ran
            more = nxt is _IDLE and bool(self._fifo)
        if more:
            self._on_loop(self._wake.set)
        if self._watched or self._tells_idle:  # else _signal has nobody to tell
            self._signal()
        return False

    def tell_nowait(self, msg: M, operands: Any = None) -> None:
        """Send ``msg`` without waiting for a reply; raise at once if it cannot be queued."""
        self._deliver(Envelope(msg, operands, None), msg)

    async def tell(self, msg: M, operands: Any = None) -> None:
        """Send ``msg`` (on the loop), waiting for mailbox space instead of failing."""
        while True:
            try:
                return self._deliver(Envelope(msg, operands, None), msg)
            except MailboxFullError:
                await self._until(lambda: self.pending < self._capacity)

    def ask_nowait(
        self,
        msg: M,
        operands: Any = None,
        *,
        reply: Reply[Any] | None = None,
        timeout: float | None = None,
        here: bool = True,
    ) -> Reply[Any]:
        """Send ``msg`` from any thread; return its reply (``reply``, else a new one), failed
        past ``timeout``. With ``here=False`` the sender never runs the turn itself (a loop's
        thread that must not block)."""
        reply = Reply() if reply is None else reply
        env: Envelope[M] = Envelope(msg, operands, reply)
        if timeout is not None and (loop := self._loop) is not None:
            if on_loop(loop):
                _arm(env, loop, self.name, timeout)
            else:
                loop.call_soon_threadsafe(_arm, env, loop, self.name, timeout)
        self._deliver(env, msg, here=here)
        return reply

    # ---- replies taken over --------------------------------------------------------

    def defer(self, env: Envelope[M]) -> Callable[[BaseException | None, Any], None]:
        """Take over ``env``'s reply; the callable returned settles it once, from any thread."""
        with self._mutex:
            self._deferred.add(env)

        def settle(exc: BaseException | None, value: Any = None) -> None:
            with self._mutex:
                if env not in self._deferred:
                    return
                self._deferred.discard(env)
                self._failed += exc is not None
            # Signalled before the reply is: whatever the replied-to caller sends next is
            # handled after the loop heard that this actor went idle.
            try:
                self._signal()
            finally:
                env.settle(exc, value)
                if env.reply is None and isinstance(exc, Exception):  # a failed tell
                    self.break_with(exc)

        return settle

    def holds(self, env: Envelope[M]) -> bool:
        """Whether ``env``'s reply was taken over (:meth:`defer`) and is not settled yet."""
        return env in self._deferred

    def forget(self, env: Envelope[M], exc: BaseException) -> None:
        """Give up ``env`` (an interrupted turn): fail its reply with ``exc`` if it is not
        settled, whether taken over or not, without breaking the actor."""
        with self._mutex:
            self._deferred.discard(env)
        try:
            self._signal()
        finally:
            env.settle(exc)

    def break_with(self, cause: BaseException) -> None:
        """Mark the actor broken: queued and later sends fail with ``ActorBrokenError``."""
        with self._mutex:
            if self._state is not ActorState.RUNNING:
                return
            self._state = ActorState.BROKEN
            self._cause = cause
            left = [*self._fifo, *self._deferred]
            self._fifo.clear()
            self._deferred.clear()
        broken = ActorBrokenError("actor broke", actor=self.name, cause=cause)
        for env in left:
            env.settle(broken)
        self._signal()

    # ---- the turn ------------------------------------------------------------------

    def _signal(self) -> None:
        # What the actor holds changed: tell the hook if it holds nothing, and the loop if
        # it waits for a change.
        if self._tells_idle and self._turn is _IDLE and not (self._fifo or self._deferred):
            self.went_idle()
        if self._watched:
            self._on_loop(self._changed_now)

    def _changed_now(self) -> None:
        self._watched = False
        self._changed.set()

    def _refusal(self) -> ActorClosedError | ActorBrokenError:
        # What a send to (or an envelope left in) an actor that does not run gets.
        if self._state is ActorState.BROKEN:
            return ActorBrokenError("actor is broken", actor=self.name, cause=self._cause)
        return ActorClosedError(f"actor is {self._state.value}", actor=self.name)

    def _on_loop(self, fn: Callable[[], object]) -> None:
        # ``fn`` on the loop's thread: now if this is it, else scheduled there.
        if (loop := self._loop) is not None and running_loop() is loop:
            fn()
        elif loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(fn)

    def _run_turn(self, env: Envelope[M]) -> None:
        # The claimed turn (TURN, set by the claimer): handle ``env``, end the turn.
        try:
            _turns.inside = True
            result = self.receive(env)
        except Exception as exc:
            self.count_failure()
            if env.reply is None:
                self.break_with(exc)
            else:
                env.settle(exc)
        except BaseException as exc:
            # An interrupt (KeyboardInterrupt, SystemExit): a reply the handler did not take
            # over fails with it; the interrupt goes on to the thread's caller as itself.
            if env not in self._deferred:
                env.settle(exc)
            raise
        else:
            if result is not DEFERRED:
                env.settle(None, result)
        finally:
            _turns.inside = False
            self.end_turn()

    async def _run(self) -> None:
        # Runs on the loop, in FIFO order, what queued.
        wake = self._wake
        while True:
            await wake.wait()
            wake.clear()
            while True:
                with self._mutex:
                    nxt = TURNS.get((self._turn, _RUN))
                    if nxt is None or not self._fifo:
                        break
                    env = self._fifo.popleft()
                    running = self._state is ActorState.RUNNING
                    if running:
                        self._turn = nxt
                if running:
                    self._run_turn(env)
                else:
                    env.settle(self._refusal())
                # Drop the envelope now: an idle actor must not keep the last reply (and
                # any tensors riding beside it) alive while it waits.
                del env


def _arm(env: Envelope[Any], loop: asyncio.AbstractEventLoop, actor: str, timeout: float) -> None:
    # Fail ``env``'s reply past ``timeout`` seconds, unless it is settled by then.
    if (reply := env.reply) is not None and not reply.done():
        exc = DeadlineExceededError(
            actor=actor, message_type=type(env.msg).__name__, timeout=timeout
        )
        env._timer = loop.call_later(timeout, reply.settle, exc)
