"""GatherActor: validate, plan and order gathers/scatters; own operands; fence block ids.

Theory of operation. A ``Transfer`` is validated and planned in the GatherActor's turn (on
the caller's thread when the actor is idle, see Threads below) from tensor metadata alone
(``plan_transfer`` reads shapes, strides, dtypes and devices, never data), so a bad request
fails its ask before anything is enqueued (rule 5, fail closed). A valid plan
becomes one ``Launch`` on the StreamActor of the requested stream, with the kernel and the
operands in its lease. The transfer enters the :class:`~kvactors.core.ordering.BlockLedger` on the
blocks it touches and leaves it when the StreamActor answers, that is, after the device
completed the copy (or failed). A ``Fence`` snapshots the transfers in flight on its blocks
and is answered when the last of them left the ledger (rule 4, fence before reuse). A failed
transfer answers its ask with the failure: it is never reported as done.

Plans are validated once: a :class:`~kvactors.core.plan_cache.PlanCache` reuses the plan of a
request whose operands' metadata has not changed and validates anything else.

Threads. The actor takes turns on any thread (``turns_anywhere``). A blocking transfer that
finds this actor and its stream's StreamActor idle is a *plain call* (:meth:`transfer_now`):
the calling thread takes both turns without a message, validates and plans, enters the
ledger, gives the gather turn back and launches the copy, and the return value is the reply.
Contended plain calls sleep on *routes*, two locks taken hand over hand (this actor's for its
turn, then the stream's, taken before the first is let go: stream order is gather order), so
the next caller plans while the copy before it runs. A copy that completes once launched
(CPU) takes the stream turn shared and lets the stream's route go: copies of several callers
run side by side, unless one would write a block another in flight touches (or read one it
writes), which waits for that one first (:meth:`BlockLedger.begin_apart
<kvactors.core.ordering.BlockLedger.begin_apart>`, then a fence). A plain call never
overtakes a queued message: its claim fails while anything is queued, and it takes the
mailbox. A sender that
finds the actor idle runs a mailbox turn on its own thread too; the turn ends once the
``Launch`` holds its place in the stream's mailbox (a send from inside a turn queues: the
loop runs the stream's turn). Messages queued behind a busy actor are handled on the loop,
in order. The ledger entry is
made before the copy is launched, so a fence taken after the turn waits for the copy.
Completions arrive from whichever thread saw the work complete, so the block ledger, the
counters and the fences are kept under one lock.

Stopping gives running transfers the stop timeout; a transfer still running then is failed
with :class:`~kvactors.errors.TransferAbandonedError` (it may still land), never with the
"not served" :class:`~kvactors.errors.ActorClosedError`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import msgspec
import torch

from kvactors.actors.actor import Actor, running_loop, take_route
from kvactors.actors.envelope import DEFERRED, Envelope, unreachable
from kvactors.actors.reply import Reply
from kvactors.actors.stream import Work
from kvactors.core.layouts import Direction
from kvactors.core.ordering import BlockLedger
from kvactors.core.plan_cache import PlanCache
from kvactors.core.protocols.gather import (
    Fence,
    Fenced,
    GatherRequest,
    Ping,
    Pong,
    Transfer,
    TransferDone,
)
from kvactors.core.protocols.stream import Launch
from kvactors.errors import (
    OperandTypeError,
    TransferAbandonedError,
    transfer_failed,
)
from kvactors.kernels.transfer import ScratchCache
from kvactors.kernels.transfer import torch_kernel as make_kernel

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from kvactors.actors.directory import StreamDirectory
    from kvactors.actors.stream import StreamActor
    from kvactors.core.plans import TransferPlan, TransferRequest
    from kvactors.devices.base import Backend

__all__ = ("GatherActor", "TransferOperands")

_log = logging.getLogger(__name__)
_D2H = Direction.D2H


@final
class TransferOperands(msgspec.Struct, eq=False):
    """The operand bundle of a :class:`Transfer`: paged KV structure and host chunks."""

    paged: Any
    objects: Sequence[torch.Tensor]


class GatherActor(Actor[GatherRequest]):
    """Plans and orders transfers for one device and answers fences on block ids."""

    accepts = (Transfer, Fence, Ping)
    turns_anywhere = True

    def __init__(
        self,
        name: str,
        *,
        backend: Backend,
        index: int,
        streams: StreamDirectory,
        capacity: int = 1024,
    ) -> None:
        super().__init__(name, capacity=capacity)
        self.backend = backend
        self.index = index
        self._streams = streams
        self._ledger = BlockLedger()
        self._ledger_lock = threading.Lock()  # ledger, counters, fences: any thread
        # Transfers handed to a stream and not answered: their settles (for a stop).
        self._running: dict[int, Callable[[BaseException | None, Any], object]] = {}
        self.plans = PlanCache(backend.kind, index)
        self._fences: dict[int, tuple[Callable[..., object], tuple[int, ...], int]] = {}
        self._fence_ids = itertools.count()
        self._scratch: dict[int, ScratchCache] = {}
        streams.on_retire(self._forget_stream)
        self.bytes_moved = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        # The backend's declared capabilities: a backend whose launch runs the work at once
        # (CPU) and that adds no layout rule or native kernel runs the specialised kernel of
        # a reused plan.
        self._prepares = backend.prepares_transfers
        self._completes = backend.completes_on_launch
        self._route = threading.Lock()
        # A native hook with no provider costs nothing: not called at all. An instance whose
        # hook was replaced (its own ``transfer_kernel``, also after the start) is called.
        self._native = backend.native_kernels and backend.native_provided()
        self._backend_attrs: dict[str, Any] = getattr(backend, "__dict__", {})
        self._plain = backend.plain_transfers

    @property
    def inflight(self) -> int:
        """Transfers planned and not yet completed."""
        with self._ledger_lock:
            return self._ledger.inflight

    @property
    def scratch_allocations(self) -> int:
        """Staging buffers ever allocated by this device's staged kernels (flat when warm)."""
        return sum(c.allocations for c in list(self._scratch.values()))

    async def on_stop(self, closed: Any) -> None:
        """Fail every transfer still running with :class:`TransferAbandonedError`: it was
        handed to its stream, so it may still land (the drain before gave it the timeout).
        Release the staging buffers."""
        with self._ledger_lock:
            running = dict(self._running)  # each leaves _running when its stream answers
        # Staging buffers go with the runtime (a kernel still running keeps its own).
        self._scratch.clear()
        device = f"{self.backend.kind}:{self.index}"
        for tid, settle in running.items():
            settle(
                TransferAbandonedError(
                    "the runtime closed before the device finished it; the copy may still "
                    "land: synchronize the stream (or end the process) before reusing its memory",
                    transfer_id=tid,
                    device=device,
                ),
                None,
            )

    def receive(self, env: Envelope[GatherRequest]) -> Any:
        """Dispatch one message."""
        msg = env.msg
        match msg:
            case Ping():
                return Pong(seq=msg.seq)
            case Transfer():
                return self._transfer(env, msg)
            case Fence():
                return self._fence(env, msg)
            case _:
                return unreachable(msg)

    def _transfer(self, env: Envelope[GatherRequest], msg: Transfer) -> Any:
        ops = env.operands
        env.operands = None
        if not isinstance(ops, TransferOperands):
            raise OperandTypeError(
                f"Transfer needs a TransferOperands bundle, got {type(ops).__name__}",
                field="operands",
            )
        loop = self.loop
        plan, kernel = self._plan(
            msg.request,
            ops.paged,
            ops.objects,
            msg.stream_handle,
            loop is not None and running_loop() is not loop,
        )

        tid = msg.transfer_id
        nbytes = plan.nbytes
        touched = plan.touched_blocks
        launch = Launch(transfer_id=tid, nbytes=nbytes)
        answer = TransferDone(transfer_id=tid, nbytes=nbytes, blocks=len(touched))
        settle: Callable[[BaseException | None, Any], None]

        def on_done(exc: BaseException | None, _value: Any) -> None:
            if exc is not None:
                self._stream_failed(msg.stream_handle)
            try:
                released = self._end(tid, exc is None, nbytes)
            finally:
                if exc is None:
                    settle(None, answer)
                elif msg.complete or self.holds(env):  # not answered when enqueued
                    settle(exc, None)
                elif isinstance(exc, Exception):
                    _log.error("transfer %d failed after it was enqueued: %s", tid, exc)
            if released:
                self._release(released)

        # Every exit settles: until the stream holds the Launch, an exception or an interrupt
        # fails the transfer here (its ledger entry ends); from then on the stream answers.
        sent: StreamActor | None = None  # the actor that holds the Launch
        try:
            settle = self.defer(env)
            self._begin(tid, touched, settle)
            # Answered once enqueued (complete=False): the lease stays with the stream and
            # the blocks stay in the ledger until the device completed (own until done,
            # fence before reuse).
            on_enqueued = None if msg.complete else functools.partial(settle, None, answer)
            # Own until done (rule 3): the lane keeps ``work`` until the device completed it,
            # and with it ``kernel``, which references the operands (through
            # ``torch_kernel``, which every backend kernel wraps, and the plan ticket's
            # tensors). No separate keepalive.
            work = Work(kernel, on_enqueued=on_enqueued)
            sent = self._streams.send(msg.stream_handle, launch, work, reply=Reply(on_done))
        except BaseException as exc:
            if sent is None and self.holds(env):
                on_done(exc, None)
            if not isinstance(exc, Exception):
                raise
        return DEFERRED

    def transfer_now(
        self,
        tid: int,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        handle: int,
        complete: bool,
        wait: float,
        admit: Callable[[], object] | None = None,
    ) -> TransferDone | None:
        """The plain-call turn of a ``Transfer`` (see Threads): ``None`` (nothing ran, nothing
        changed: send the message) unless this actor and the stream's StreamActor are idle
        and the stream's lane holds nothing to run. Then the calling thread takes both turns,
        validates and plans, enters the ledger, gives the gather turn back and launches the
        copy, as the two turns would, and returns the reply: at once where the launch is the
        copy (CPU) or with ``complete=False``; else once the stream's reaper saw the copy
        complete (the turns and routes are given back before that wait). Raises what the
        message's reply would raise."""
        stream = self._streams.peek(handle)  # a dict's own get: no frame
        if stream is None:
            return None
        completes = self._completes
        # ``given``: the stream's launch_now called ``enter`` (this call's ledger entry made,
        # its gather turn and route given back); from then on launch_now ends the entry, and
        # where the copy completed in it this call does. Until then this call's ``finally``
        # gives back what it holds, then the exception propagates, as itself.
        given: list[int] = []
        on_route = in_gather = False
        nbytes = 0
        try:
            on_route = self._route.acquire(False) or take_route(self._route, self, wait)
            if not on_route:
                return None
            in_gather = self.claim()
            if not in_gather:
                return None
            if admit is not None:
                admit()  # in the gather turn: admission order is the turns' order
            plan, kernel = self._plan(request, paged, objects, handle, True)
            nbytes = plan.nbytes
            touched = plan.touched_blocks
            done: Reply[None] | None = Reply() if complete and not completes else None
            launched = stream.launch_now(
                tid,
                kernel,
                wait,
                functools.partial(
                    self._begin_plain, tid, touched, done, completes, plan.direction is _D2H, given
                ),
                functools.partial(self._reaped, tid, nbytes, handle, done),
            )
            if launched is None:
                return None
            if completes:  # the copy ran in launch_now: its ledger exit
                self._done_now(tid, nbytes)
            if done is None:
                return TransferDone(transfer_id=tid, nbytes=nbytes, blocks=len(touched))
        except BaseException as exc:
            if not given:
                if in_gather and isinstance(exc, Exception):
                    self.count_failure()  # refused in the gather turn
            elif completes:  # the copy ran, or failed, in launch_now: the entry ends (once)
                self._release(self._end(tid, False, nbytes))
            raise
        finally:
            if not given:  # else _begin_plain gave them back
                if in_gather:
                    self.end_turn()
                if on_route:
                    self._route.release()
        done.wait(wait, "Transfer")  # the reaper's answer (it owns the ledger entry now)
        return TransferDone(transfer_id=tid, nbytes=nbytes, blocks=len(touched))

    def _plan(
        self,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        handle: int,
        bind_now: bool,
    ) -> tuple[TransferPlan, Callable[[], None]]:
        # A Transfer's gather turn, both drivers (the mailbox turn, the plain call): the
        # device layout rules (MLU vLLM layouts, MUSA format set), validation and the plan
        # (metadata only), then its kernel: a plan from the cache runs its specialised
        # kernel (a plain backend's bound here off the loop, else where the launch runs; a
        # device backend's staged binding in the launch). The backend may put an opted-in
        # native transfer first (it may decline).
        if self._prepares:
            request, paged, objects = self.backend.prepare_transfer(request, paged, objects)
        found = self.plans.lookup(request, paged, objects)
        plan = found.plan
        scratch = must_block = None
        if not self._plain:
            scratch = self._scratch.get(handle)
            if scratch is None:
                scratch = self._scratch[handle] = ScratchCache()
            must_block = self.backend.must_block
        kernel = make_kernel(
            plan,
            paged,
            objects,
            memo=found.memo,
            inference=found.inference,
            must_block=must_block,
            scratch=scratch,
            bind_now=bind_now,
        )
        if self._native or "transfer_kernel" in self._backend_attrs:
            kernel = self.backend.transfer_kernel(plan, paged, objects, kernel)
        return plan, kernel

    def _reaped(
        self,
        tid: int,
        nbytes: int,
        handle: int,
        done: Reply[None] | None,
        err: BaseException | None,
    ) -> None:
        # A plain call's copy completed (or failed: the stream is past it); ``done``: its
        # waiting caller.
        released = self._end(tid, err is None, nbytes)
        if err is not None:
            self._stream_failed(handle)
            if done is None and isinstance(err, Exception):
                _log.error("transfer %d failed after it was enqueued: %s", tid, err)
        try:
            self._release(released)
        finally:
            if done is not None:
                device = f"{self.backend.kind}:{self.index}"
                done.settle(None if err is None else transfer_failed(err, tid, device))

    def _done_now(self, tid: int, nbytes: int) -> None:
        # The ledger exit of a plain-call copy that completed in its launch (a call of its
        # own: an interrupt lands on no line between the lock's enter and exit).
        with self._ledger_lock:
            released = self._ledger.finish(tid)
            self.transfers_ok += 1
            self.bytes_moved += nbytes
        if released:
            self._release(released)

    def _begin_plain(
        self,
        tid: int,
        touched: frozenset[int],
        done: Reply[None] | None,
        shared: bool,
        reads: bool,
        given: list[int],
    ) -> Reply[Any] | None:
        # A plain call's ledger entry, made in its stream turn (``enter`` of
        # StreamActor.launch_now), then its gather turn and route given back (``given``
        # says so): the next sender plans while this copy runs. A waiting caller's reply is
        # failed by a stop, as a running transfer's. ``shared`` (a copy beside others;
        # ``reads``: it only reads its blocks): if it may not run beside a transfer in flight
        # on its blocks, a fence on them, which the copy waits for.
        try:
            with self._ledger_lock:
                ledger = self._ledger
                if done is not None:
                    self._running[tid] = done.settle
                if shared and not ledger.begin_apart(tid, touched, reads=reads):
                    fid = next(self._fence_ids)
                    after: Reply[Any] = Reply()
                    self._fences[fid] = (after.settle, (), ledger.fence(fid, touched))
                    ledger.begin(tid, touched)
                    return after
                if not shared:
                    ledger.begin(tid, touched)
                return None
        finally:
            given.append(tid)
            self.end_turn()
            self._route.release()

    def _begin(
        self, tid: int, touched: Iterable[int], settle: Callable[[BaseException | None, Any], None]
    ) -> None:
        with self._ledger_lock:
            self._ledger.begin(tid, touched)
            self._running[tid] = settle

    def _end(self, tid: int, ok: bool, nbytes: int) -> list[int]:
        # A transfer's ledger exit, once (the mailbox's and the plain call's; ``_running``
        # holds it while a caller waits): the fences it releases.
        with self._ledger_lock:
            if tid not in self._ledger:
                return []  # never begun, or ended already
            self._running.pop(tid, None)
            released = self._ledger.finish(tid)
            if ok:
                self.transfers_ok += 1
                self.bytes_moved += nbytes
            else:
                self.transfers_failed += 1
        return released

    def _stream_failed(self, handle: int) -> None:
        # Work on the stream failed (any thread): block ids its kernels uploaded without
        # waiting may never have landed, and a later synchronize may clear the error.
        scratch = self._scratch.get(handle)
        if scratch is not None:
            scratch.invalidate()

    def _forget_stream(self, handle: int) -> None:
        # The stream's actor retired idle: no work of it is left, its staging buffers go.
        self._scratch.pop(handle, None)

    def _fence(self, env: Envelope[GatherRequest], msg: Fence) -> Any:
        fid = next(self._fence_ids)
        with self._ledger_lock:
            waits = self._ledger.fence(fid, msg.block_ids)
            if waits == 0:
                return Fenced(block_ids=msg.block_ids, waited_for=0)
            self._fences[fid] = (self.defer(env), msg.block_ids, waits)
        return DEFERRED

    def _release(self, fence_ids: list[int]) -> None:
        if not fence_ids:
            return
        with self._ledger_lock:
            released = [self._fences.pop(fid) for fid in fence_ids]
        for settle, block_ids, waits in released:
            settle(None, Fenced(block_ids=block_ids, waited_for=waits))
