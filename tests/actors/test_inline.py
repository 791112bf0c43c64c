"""No idle hops: transfers run on the caller's thread only when nothing can be ordered before
them, and everything submitted after them still waits for them (lane order, fences).

The tests wait for states (ManualBackend's condition variable, the lane's held-back count),
never on time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from kvactors.actors.group import DeviceActors
from kvactors.actors.lane import Lane
from kvactors.devices.cpu import CpuBackend
from kvactors.errors import TransferFailedError
from kvactors.layouts import Direction, KVFormat, ShapeDesc
from kvactors.plans import TransferRequest
from kvactors.protocols.gather import Fence, Fenced
from kvactors.runtime import Runtime
from tests._manual_backend import ManualBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.devices.base import StreamLike

NL, NB, BS, NH, HS = 2, 8, 4, 2, 8
T = 2 * BS


def _request(
    ids: tuple[int, ...] = (1, 4), direction: Direction = Direction.D2H
) -> TransferRequest:
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    return TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(direction),
        block_ids=ids,
        chunk_size=T,
        shape=shape,
    )


def _operands() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    base = torch.randn(NL, 2, NB, BS, NH, HS).to(torch.bfloat16)
    return list(base.unbind(0)), [torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16)]


def _lane() -> Lane:
    backend = CpuBackend()
    lane = Lane("t", backend, 0, backend.stream_from_handle(0, 0))
    lane.start()
    return lane


def test_job_submitted_during_inline_work_runs_after_it() -> None:
    lane = _lane()
    try:
        assert lane.claim_inline()
        seen: list[int] = []
        ran = threading.Event()

        def job() -> None:
            seen.append(lane.inline)
            ran.set()

        lane.submit(job)
        while not (ran.is_set() or lane.held_back):
            pass  # the lane thread either ran the job (rule broken) or holds it back
        lane.end_inline()
        assert ran.wait(10)
        assert seen == [0], "a job queued behind inline work ran before that work ended"
    finally:
        assert lane.stop(10)


def test_no_inline_claim_while_a_job_is_queued_and_concurrent_claims_overlap() -> None:
    lane = _lane()
    try:
        gate = threading.Event()

        def hold() -> None:
            gate.wait(10)

        lane.submit(hold)
        assert not lane.claim_inline()  # would overtake the queued job
        gate.set()
        done = threading.Event()
        lane.submit(done.set)
        assert done.wait(10)
        while lane.pending:
            pass
        # Idle: two callers may run inline at once (they are concurrent, nothing orders them).
        assert lane.claim_inline()
        assert lane.claim_inline()
        assert lane.inline == 2
        lane.end_inline()
        lane.end_inline()
    finally:
        assert lane.stop(10)


def test_blocking_transfer_on_idle_cpu_runtime_runs_on_the_calling_thread() -> None:
    paged, objs = _operands()
    with Runtime("cpu") as rt:
        assert rt.inline
        done = rt.transfer(_request(), paged, objs)
        assert done.blocks == 2
        actors = rt._actors
        assert actors is not None
        stream = actors.streams.peek(0)
        assert stream is not None
        assert stream.statistics().processed == 0  # no Launch: the copy ran on this thread
        assert rt.statistics().transfers_ok == 1
        ref = torch.stack(paged)  # [L, 2, NB, BS, NH, HS]
        got = objs[0].view(2, NL, 2, BS, NH, HS)
        assert torch.equal(got[:, :, 0], ref[:, :, 1].transpose(0, 1))
        assert torch.equal(got[:, :, 1], ref[:, :, 4].transpose(0, 1))


def test_inline_off_keeps_every_transfer_on_the_lane() -> None:
    paged, objs = _operands()
    with Runtime("cpu", inline=False) as rt:
        rt.transfer(_request(), paged, objs)
        actors = rt._actors
        assert actors is not None
        stream = actors.streams.peek(0)
        assert stream is not None
        assert stream.statistics().processed == 1  # one Launch


async def test_fence_waits_for_an_inline_transfer_in_flight() -> None:
    backend = ManualBackend()  # launched work runs only when released
    paged, objs = _operands()
    async with DeviceActors(backend) as dev:
        stream = dev.streams.get(0)
        result: list[object] = []

        def caller() -> None:
            result.append(dev.gather.run_inline(7, _request(), paged, objs, stream.lane))

        t = threading.Thread(target=caller)
        t.start()
        try:
            assert await _wait(backend, lambda b: b.queued() == 1)
            fence = dev.gather.ask_nowait(Fence(block_ids=(4,)))
            assert not fence.done(), "a fence taken during an inline transfer did not wait"
            untouched = dev.gather.ask_nowait(Fence(block_ids=(2,)))
            assert untouched.done()
        finally:
            backend.release()  # never leave the caller blocked, even when the check failed
        await _join(t)
        answer = await fence
        assert isinstance(answer, Fenced)
        assert answer.waited_for == 1
        assert len(result) == 1


async def _wait(backend: ManualBackend, pred: object) -> bool:
    import asyncio

    return await asyncio.to_thread(backend.wait_for, pred, 10.0)  # type: ignore[arg-type]


async def _join(t: threading.Thread) -> None:
    import asyncio

    await asyncio.to_thread(t.join, 10)
    assert not t.is_alive()


def test_enqueued_return_keeps_operands_owned_and_blocks_fenced_until_done() -> None:
    import gc

    backend = ManualBackend()  # launched work runs only when released
    with Runtime(backend) as rt:
        paged, objs = _operands()
        done = rt.transfer(_request(), paged, objs, complete=False)
        assert done.blocks == 2
        assert backend.queued() == 1  # returned with the copy enqueued, not run
        assert rt.statistics().inflight == 1  # still in the ledger: fences wait for it
        del paged, objs
        gc.collect()
        backend.release()
        rt.synchronize()
        assert backend.use_after_free == 0  # the runtime kept the operands until done
        assert rt.fence((1, 4)).waited_for == 0
        assert rt.statistics().transfers_ok == 1


def test_complete_mode_returns_only_after_the_device_ran() -> None:
    backend = ManualBackend()
    with Runtime(backend) as rt:
        paged, objs = _operands()
        returned = threading.Event()

        def caller() -> None:
            rt.transfer(_request(), paged, objs)
            returned.set()

        t = threading.Thread(target=caller)
        t.start()
        assert backend.wait_for(lambda b: b.queued() == 1)
        assert not returned.is_set()
        backend.release()
        t.join(10)
        assert returned.is_set()


class _LaunchFailsAfterEnqueue(ManualBackend):
    """A device whose launch enqueued work and then failed (an allocation failing between
    two copies of one kernel, say): the enqueued part still runs on the stream."""

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        super().launch(stream, fn)
        raise RuntimeError("launch failed after enqueueing work")


def test_failed_inline_launch_returns_only_after_the_stream_ran_what_it_enqueued() -> None:
    backend = _LaunchFailsAfterEnqueue()
    with Runtime(backend, inline=True) as rt:
        paged, objs = _operands()
        errors: list[BaseException] = []
        returned = threading.Event()

        def caller() -> None:
            try:
                rt.transfer(_request(), paged, objs)
            except BaseException as exc:
                errors.append(exc)
            finally:
                returned.set()

        t = threading.Thread(target=caller)
        t.start()
        try:
            # The caller waits in the stream sync behind the enqueued work; one that returned
            # at once (free to reuse its chunks while the device still writes) never does.
            waited = backend.wait_for(lambda b: b.queued() == 1 and b.sync_waiters >= 1)
            assert waited, "the failed inline transfer returned before its enqueued work ran"
            assert not returned.is_set()
        finally:
            backend.release()
        t.join(10)
        assert returned.is_set()
        assert len(errors) == 1
        assert isinstance(errors[0], TransferFailedError)
        assert "launch failed after enqueueing work" in str(errors[0])
        assert backend.use_after_free == 0
        assert rt.statistics().transfers_failed == 1
