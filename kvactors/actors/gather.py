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
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, final

from kvactors.actors.actor import DEFERRED, Actor, Envelope, unreachable
from kvactors.actors.stream import Work
from kvactors.errors import OperandTypeError
from kvactors.kernels.fast import ScratchCache, run_fast
from kvactors.ordering import BlockLedger
from kvactors.plans import plan_transfer
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

    import torch

    from kvactors.actors.directory import StreamDirectory
    from kvactors.devices.base import Backend

__all__ = ("GatherActor", "TransferOperands")


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
        self._fences: dict[int, tuple[Callable[..., None], tuple[int, ...], int]] = {}
        self._fence_ids = itertools.count()
        self._scratch: dict[int, ScratchCache] = {}
        self.bytes_moved = 0
        self.transfers_ok = 0
        self.transfers_failed = 0

    @property
    def inflight(self) -> int:
        """Transfers planned and not yet completed."""
        return self._ledger.inflight

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
        plan = plan_transfer(
            request,
            paged,
            objects,
            device_type=self.backend.kind,
            device_index=self.index,
        )
        stream = self._streams.get(msg.stream_handle)
        scratch = self._scratch.get(msg.stream_handle)
        if scratch is None:
            scratch = self._scratch[msg.stream_handle] = ScratchCache()
        copy = self.backend.copy_

        def torch_kernel() -> None:
            run_fast(plan, paged, objects, copy=copy, scratch=scratch)

        # The backend may put an opted-in native transfer first (it may decline).
        kernel = self.backend.transfer_kernel(plan, paged, objects, torch_kernel)

        launch = Launch(transfer_id=msg.transfer_id, nbytes=plan.nbytes)
        tid = msg.transfer_id
        blocks = len(plan.touched_blocks)
        self._ledger.begin(tid, plan.touched_blocks)
        settle = self.defer(env)

        def on_done(exc: BaseException | None, _value: Any) -> None:
            released = self._ledger.finish(tid)
            if exc is not None:
                self.transfers_failed += 1
                settle(exc, None)
            else:
                self.transfers_ok += 1
                self.bytes_moved += plan.nbytes
                settle(None, TransferDone(transfer_id=tid, nbytes=plan.nbytes, blocks=blocks))
            self._release(released)

        try:
            stream.ask_into(_Callback(on_done), launch, Work(kernel, keepalive=(paged, objects)))
        except Exception as exc:
            on_done(exc, None)
        return DEFERRED

    def _fence(self, env: Envelope[GatherRequest], msg: Fence) -> Any:
        fid = next(self._fence_ids)
        waits = self._ledger.fence(fid, msg.block_ids)
        if waits == 0:
            return Fenced(block_ids=msg.block_ids, waited_for=0)
        self._fences[fid] = (self.defer(env), msg.block_ids, waits)
        return DEFERRED

    def _release(self, fence_ids: list[int]) -> None:
        for fid in fence_ids:
            settle, block_ids, waits = self._fences.pop(fid)
            settle(None, Fenced(block_ids=block_ids, waited_for=waits))
