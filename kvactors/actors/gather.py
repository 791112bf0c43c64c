"""GatherActor: validate, plan and order gathers/scatters; own operands; fence block ids.

Theory of operation. A ``Transfer`` is validated and planned on the event loop from tensor
metadata alone (``plan_transfer`` reads shapes, strides, dtypes and devices, never data), so a
bad request fails its ask before anything is enqueued (rule 5, fail closed). A valid plan
becomes one ``Launch`` on the StreamActor of the requested stream, with the kernel and the
operands in its lease. The transfer enters the :class:`~kvactors.ordering.BlockLedger` on the
blocks it touches and leaves it when the StreamActor answers, that is, after the device
completed the copy (or failed). A ``Fence`` snapshots the transfers in flight on its blocks
and is answered when the last of them left the ledger (rule 4, fence before reuse). A failed
transfer answers its ask with the failure: it is never reported as done.

Plans are validated once: a :class:`~kvactors.plan_cache.PlanCache` reuses the plan of a
request whose operands' metadata has not changed and validates anything else.

No idle hop. :meth:`GatherActor.run_inline` is the same transfer run on the caller's thread,
for a blocking caller on a device whose work is complete when launched (CPU), when the
runtime has no message in transit and the stream's lane is idle (``Lane.claim_inline``): it
validates (or reuses) the plan, enters the ledger, runs the kernel, leaves the ledger, all on
the calling thread. The ledger and the counters are therefore shared with the loop under
``_shared``, a lock held only around their updates; fences released by an inline transfer
are settled on the loop, in the actor's turn. A transfer entered in the ledger before a
``Fence`` was handled is waited for by that fence, whichever thread runs it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, final

import torch

from kvactors.actors.actor import DEFERRED, Actor, Envelope, unreachable
from kvactors.actors.stream import Work
from kvactors.devices.base import Backend
from kvactors.devices.cpu import completes_on_launch
from kvactors.errors import KvactorsError, OperandTypeError, TransferFailedError
from kvactors.kernels.fast import ScratchCache, reused_kernel, run_fast
from kvactors.ordering import BlockLedger
from kvactors.plan_cache import PlanCache
from kvactors.protocols.gather import (
    Fence,
    Fenced,
    GatherRequest,
    Ping,
    Pong,
    Transfer,
    TransferDone,
)
from kvactors.protocols.stream import Launch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.actors.directory import StreamDirectory
    from kvactors.actors.lane import Lane
    from kvactors.plan_cache import KernelMemo
    from kvactors.plans import TransferPlan, TransferRequest

__all__ = ("GatherActor", "TransferOperands")

_log = logging.getLogger(__name__)


@final
class TransferOperands:
    """The operand bundle of a :class:`Transfer`: paged KV structure and host chunks."""

    __slots__ = ("objects", "paged")

    def __init__(self, paged: Any, objects: Sequence[torch.Tensor]) -> None:
        self.paged = paged
        self.objects = objects


@final
class _Callback:
    """A reply slot that calls ``fn(exc, value)`` when settled: the StreamActor's answer
    reaches the GatherActor in the same loop turn, without a future's scheduled callback."""

    __slots__ = ("_done", "_fn")

    def __init__(self, fn: Callable[[BaseException | None, Any], None]) -> None:
        self._fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        if not self._done:
            self._done = True
            self._fn(None, value)

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self._fn(exc, None)


class GatherActor(Actor[GatherRequest]):
    """Plans and orders transfers for one device and answers fences on block ids."""

    accepts = (Transfer, Fence, Ping)

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
        self._shared = threading.Lock()  # ledger and counters: loop and inline callers
        self.plans = PlanCache(backend.kind, index)
        self._fences: dict[int, tuple[Callable[..., None], tuple[int, ...], int]] = {}
        self._fence_ids = itertools.count()
        self._scratch: dict[int, ScratchCache] = {}
        # Staging buffers of inline device calls, one cache per calling thread (a cache serves
        # one caller at a time; an inline call has synchronized its stream before it returns,
        # so the next call of that thread may reuse them). Owned here, not by the thread: they
        # go when the actor stops, not when the thread ends.
        self._inline_scratch: dict[int, ScratchCache] = {}
        streams.on_retire(self._forget_stream)
        self.bytes_moved = 0
        self.transfers_ok = 0
        self.transfers_failed = 0
        # Which of the backend's transfer hooks are the defaults, decided once: an inline
        # transfer on a backend whose launch runs the work at once (CPU) and that adds no
        # layout rule or native kernel is just the plan lookup and the torch kernel.
        cls = type(backend)
        self._plain = (
            cls.prepare_transfer is Backend.prepare_transfer
            and cls.transfer_kernel is Backend.transfer_kernel
            and completes_on_launch(backend)
        )

    @property
    def inflight(self) -> int:
        """Transfers planned and not yet completed."""
        with self._shared:
            return self._ledger.inflight

    @property
    def scratch_allocations(self) -> int:
        """Staging buffers ever allocated by this device's staged kernels (flat when warm)."""
        caches = [*self._scratch.values(), *self._inline_scratch.values()]
        return sum(c.allocations for c in caches)

    def _caller_scratch(self) -> ScratchCache:
        ident = threading.get_ident()
        cache = self._inline_scratch.get(ident)
        if cache is None:  # one thread per ident at a time: no other thread adds this key
            cache = self._inline_scratch[ident] = ScratchCache()
        return cache

    async def on_stop(self, closed: Any) -> None:
        """Release the inline callers' staging buffers (no inline call starts once the
        runtime closed; one still running keeps its own cache until it returns)."""
        self._inline_scratch.clear()

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
        # Device layout rules first (MLU vLLM layouts, MUSA format set): metadata only.
        request, paged, objects = self.backend.prepare_transfer(msg.request, ops.paged, ops.objects)
        found = self.plans.lookup(request, paged, objects)
        plan = found.plan
        stream = self._streams.get(msg.stream_handle)
        scratch = self._scratch.get(msg.stream_handle)
        if scratch is None:
            scratch = self._scratch[msg.stream_handle] = ScratchCache()
        copy = self.backend.copy_
        inference = found.inference
        # A plain backend's plan from the cache runs the kernel the inline path runs,
        # specialised on the lane, never on the loop.
        memo = found.memo if self._plain else None

        def torch_kernel() -> None:
            if memo is not None:
                reused_kernel(plan, paged, objects, memo, inference=inference)(paged, objects)
                return
            # Inference tensors (made under torch.inference_mode) are written only in it.
            with torch.inference_mode(inference):
                run_fast(plan, paged, objects, copy=copy, scratch=scratch)

        # The backend may put an opted-in native transfer first (it may decline).
        kernel = self.backend.transfer_kernel(plan, paged, objects, torch_kernel)

        launch = Launch(transfer_id=msg.transfer_id, nbytes=plan.nbytes)
        tid = msg.transfer_id
        blocks = len(plan.touched_blocks)
        with self._shared:
            self._ledger.begin(tid, plan.touched_blocks)
        settle = self.defer(env)
        answer = TransferDone(transfer_id=tid, nbytes=plan.nbytes, blocks=blocks)

        def on_enqueued() -> None:
            # Answer now; the lease stays with the stream and the blocks stay in the ledger
            # until the device completed (own until done, fence before reuse).
            settle(None, answer)

        def on_done(exc: BaseException | None, _value: Any) -> None:
            released = self._finish(tid, exc is None, plan.nbytes)
            if exc is not None:
                if msg.complete or not settled_early():
                    settle(exc, None)
                else:
                    _log.error("transfer %d failed after it was enqueued: %s", tid, exc)
            else:
                settle(None, answer)
            self._release(released)

        def settled_early() -> bool:
            return env not in self._deferred

        # Own until done (rule 3): the lane keeps ``work`` until the device completed it, and
        # with it ``kernel``, which references the operands (through ``torch_kernel``, which
        # every backend kernel wraps, and the plan ticket's tensors). No separate keepalive.
        work = Work(kernel, on_enqueued=None if msg.complete else on_enqueued)
        try:
            stream.ask_into(_Callback(on_done), launch, work)
        except Exception as exc:
            on_done(exc, None)
        return DEFERRED

    def _finish(self, tid: int, ok: bool, nbytes: int) -> list[int]:
        with self._shared:
            released = self._ledger.finish(tid)
            if ok:
                self.transfers_ok += 1
                self.bytes_moved += nbytes
            else:
                self.transfers_failed += 1
        return released

    def run_inline(
        self,
        transfer_id: int,
        request: TransferRequest,
        paged: Any,
        objects: Sequence[torch.Tensor],
        lane: Lane,
    ) -> TransferDone | None:
        """Run a transfer on the calling thread (module docstring), or return ``None`` without
        touching anything when ``lane`` is not idle (then send a ``Transfer`` instead).

        Validation errors raise before anything is claimed or copied; a failed copy raises
        :class:`~kvactors.errors.TransferFailedError`.
        """
        backend = self.backend
        plain = self._plain
        if not plain:
            request, paged, objects = backend.prepare_transfer(request, paged, objects)
        found = self.plans.lookup(request, paged, objects)
        plan = found.plan
        # The reply, made while the plan is in cache (after the copy it would not be).
        done = TransferDone(
            transfer_id=transfer_id, nbytes=plan.nbytes, blocks=len(plan.touched_blocks)
        )
        if not lane.claim_inline():
            return None
        shared = self._shared
        try:
            with shared:
                self._ledger.begin(transfer_id, plan.touched_blocks)
            ok = False
            try:
                memo = found.memo
                if plain:  # launch would call the kernel at once; its marker is complete
                    if memo is None:
                        run_fast(plan, paged, objects)
                    else:
                        reused_kernel(plan, paged, objects, memo, inference=found.inference)(
                            paged, objects
                        )
                else:
                    self._launch_inline(backend, lane, plan, paged, objects, memo)
                ok = True
            except BaseException as exc:
                if not plain:
                    # What the launch enqueued before it failed still runs: the caller may
                    # reuse its operands once this raises, so wait for the stream first (own
                    # until done).
                    with contextlib.suppress(Exception):
                        backend.record_marker(lane.stream).synchronize()
                failure = _inline_failed(exc, transfer_id, f"{backend.kind}:{self.index}")
                if failure is exc:
                    raise
                raise failure from exc
            finally:
                # _finish, inline: the first Python to run after a copy pays for every
                # object it touches again, a call frame included.
                with shared:
                    released = self._ledger.finish(transfer_id)
                    if ok:
                        self.transfers_ok += 1
                        self.bytes_moved += plan.nbytes
                    else:
                        self.transfers_failed += 1
                if released and self._loop is not None:
                    # A closed loop means the runtime stopped, and its stop failed the fences.
                    with contextlib.suppress(RuntimeError):
                        self._loop.call_soon_threadsafe(self._release, released)
        finally:
            lane.end_inline()
        return done

    def _launch_inline(
        self,
        backend: Backend,
        lane: Lane,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        memo: KernelMemo | None,
    ) -> None:
        # An inline device call: the kernel launched on the lane's stream from the caller's
        # thread, staging through the caller's own buffers, then waited for.
        stream = lane.stream
        scratch = self._caller_scratch()
        backend.launch(
            stream,
            backend.transfer_kernel(
                plan,
                paged,
                objects,
                lambda: run_fast(
                    plan,
                    paged,
                    objects,
                    copy=backend.copy_,  # the device's copy policy (rule 6)
                    scratch=scratch,
                    checked=memo is not None,
                ),
            ),
        )
        backend.record_marker(stream).synchronize()

    def _forget_stream(self, handle: int) -> None:
        # The stream's actor retired idle: no work of it is left, its staging buffers go.
        self._scratch.pop(handle, None)

    def _fence(self, env: Envelope[GatherRequest], msg: Fence) -> Any:
        fid = next(self._fence_ids)
        with self._shared:
            waits = self._ledger.fence(fid, msg.block_ids)
        if waits == 0:
            return Fenced(block_ids=msg.block_ids, waited_for=0)
        self._fences[fid] = (self.defer(env), msg.block_ids, waits)
        return DEFERRED

    def _release(self, fence_ids: list[int]) -> None:
        for fid in fence_ids:
            settle, block_ids, waits = self._fences.pop(fid)
            settle(None, Fenced(block_ids=block_ids, waited_for=waits))


def _inline_failed(err: BaseException, transfer_id: int, device: str) -> BaseException:
    if isinstance(err, KvactorsError):
        return err
    return TransferFailedError(
        str(err) or type(err).__name__, transfer_id=transfer_id, device=device
    )
