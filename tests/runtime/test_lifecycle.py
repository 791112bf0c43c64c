"""The runtime shell's lifecycle: failed starts, abandoned lanes, what stop and close settle.

Each test reproduces one hole that existed and fails when its fix is reverted: a start that
reported success with actors that never started, lane threads abandoned in silence, queued
asks and leftover replies nobody failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.actors.actor import Actor
from kvactors.actors.group import DeviceActors
from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices.cpu import CpuBackend
from kvactors.errors import ActorClosedError, DeviceOpError, TransferAbandonedError
from kvactors.runtime import Runtime
from kvactors.testing.manual import ManualBackend

if TYPE_CHECKING:
    from kvactors.actors.envelope import Envelope
    from kvactors.actors.reply import Reply
    from kvactors.devices.base import IPCHandle, IPCOwner
    from kvactors.runtime.observer import Call

NL, NB, BS, NH, HS = 2, 8, 4, 2, 8


class _NoStreamBackend(CpuBackend):
    """A CPU backend whose default stream cannot be had: the actors cannot start."""

    def stream_from_handle(self, handle: int, index: int) -> Any:
        raise DeviceOpError("no stream here", device=f"cpu:{index}", op="stream_from_handle")


def _store() -> tuple[TransferRequest, list[torch.Tensor], list[torch.Tensor]]:
    shape = ShapeDesc(kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=4, dtype="float32")
    req = TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(Direction.D2H),
        block_ids=(1, 2),
        chunk_size=2 * BS,
        shape=shape,
    )
    paged = list(torch.ones(NL, 2, NB, BS, NH, HS).unbind(0))
    return req, paged, [torch.zeros(2, NL, 2 * BS, NH * HS)]


def test_start_raises_when_the_actors_fail_to_start() -> None:
    rt = Runtime(_NoStreamBackend())
    with pytest.raises(DeviceOpError, match="no stream here"):
        rt.start()
    assert "running" not in repr(rt)
    # The next call retries the start and fails the same way, not "actor is created".
    with pytest.raises(DeviceOpError, match="no stream here"):
        rt.ping()
    rt.close()


def test_close_raises_and_counts_lanes_whose_threads_did_not_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = ManualBackend()  # the device runs nothing until released: the lane waits on it
    rt = Runtime(backend, stop_timeout=0.2).start()
    req, paged, objs = _store()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(rt.transfer, req, paged, objs, timeout=30)
        assert backend.wait_for(lambda b: b.queued() == 1)
        with (
            caplog.at_level(logging.ERROR, logger="kvactors"),
            pytest.raises(DeviceOpError, match="1 stream lane") as info,
        ):
            rt.close(timeout=0.2)
        assert info.value.op == "close"
        assert any("did not end" in r.getMessage() for r in caplog.records)
        with pytest.raises(TransferAbandonedError):  # enqueued: it may still land
            call.result(timeout=10)
    backend.release()  # the abandoned lane finishes its device wait and ends


async def test_statistics_count_abandoned_lanes() -> None:
    backend = ManualBackend()
    req, paged, objs = _store()
    from kvactors.actors.gather import TransferOperands
    from kvactors.core.protocols.gather import Transfer

    dev = DeviceActors(backend, stop_timeout=0.1)
    dev.start()
    pending = dev.gather.ask_nowait(
        Transfer(transfer_id=1, request=req), TransferOperands(paged, objs)
    )
    assert await asyncio.get_running_loop().run_in_executor(
        None, backend.wait_for, lambda b: b.queued() == 1
    )
    assert dev.statistics().lanes_abandoned == 0
    await dev.stop(timeout=0.1)
    assert dev.statistics().lanes_abandoned == 1
    with pytest.raises(TransferAbandonedError):
        await pending
    backend.release()


class _AsksItself(Actor[int]):
    """On message 1, asks itself message 2 (queued: the actor is busy) and answers 1."""

    accepts = (int,)

    def __init__(self) -> None:
        super().__init__("self-asker")
        self.second: Reply[Any] | None = None

    def receive(self, env: Envelope[int]) -> Any:
        if env.msg == 1:
            self.second = self.ask_nowait(2)
        return env.msg


async def test_actor_stop_fails_queued_asks() -> None:
    actor = _AsksItself()
    actor.start()
    assert await actor.ask_nowait(1) == 1  # handled at once; its ask of 2 waits in the FIFO
    queued = actor.second
    assert queued is not None
    assert not queued.done()
    await actor.stop(graceful=False)
    assert queued.done()
    with pytest.raises(ActorClosedError, match="stopped before replying"):
        queued.result()


class _StuckOpen(CpuBackend):
    """Opening an IPC handle blocks the loop (foreign code that never returns in time)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck, self.unstick = threading.Event(), threading.Event()

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        self.stuck.set()
        self.unstick.wait(30)
        return super().ipc_open(handle)


class _Admitted:
    """An observer that opens a gate when a call of ``op`` is admitted."""

    def __init__(self, op: str) -> None:
        self.op, self.gate = op, threading.Event()

    def call_started(self, call: Call) -> None:
        if call.op == self.op:
            self.gate.set()

    def call_finished(self, call: Call, seconds: float, result: Any, error: Any) -> None:
        pass


def test_close_fails_replies_the_actors_never_settled() -> None:
    # A loop stuck in foreign code: neither the stop nor the queued ask ever runs on it, so
    # only close()'s own bookkeeping can answer the caller.
    backend = _StuckOpen()
    shared = backend.alloc_shared((4,), torch.float32)
    assert shared.tensor is not None
    admitted = _Admitted("close_ipc")
    rt = Runtime(backend, stop_timeout=0.05, default_timeout=30, observer=admitted).start()
    try:
        opener = threading.Thread(
            target=_outcome,
            args=(lambda: rt.open_ipc(backend.ipc_export(shared.tensor), context_id=1),),
        )
        opener.start()
        assert backend.stuck.wait(10)  # the IPC actor's turn runs on the loop: now stuck
        results: list[object] = []
        caller = threading.Thread(
            target=lambda: results.append(_outcome(lambda: rt.close_ipc_context(1)))
        )
        caller.start()
        assert admitted.gate.wait(10)  # registered before admission; queued behind the open
        rt.close(timeout=0.05, grace=0.05)
        caller.join(10)
        assert len(results) == 1
        assert isinstance(results[0], ActorClosedError)
        assert "runtime closed before replying" in str(results[0])
    finally:
        backend.unstick.set()
        opener.join(10)
        shared.close()


def _outcome(fn: Any) -> object:
    try:
        return fn()
    except Exception as exc:
        return exc


def test_ipc_owner_counters_reach_statistics_and_metrics() -> None:
    from kvactors.observe.metrics import samples

    cpu = CpuBackend()
    shared = cpu.alloc_shared((4,), torch.float32)
    assert shared.tensor is not None
    try:
        with Runtime("cpu") as rt:
            for ctx in (1, 2):
                rt.open_ipc(cpu.ipc_export(shared.tensor), context_id=ctx)
            rt.close_ipc_context(1)
            stats = rt.statistics()
            assert (stats.ipc_owners_opened, stats.ipc_owners_closed) == (2, 1)
            assert stats.ipc_owners_open == 1
            got = {s.name: s.value for s in samples(stats) if s.name.startswith("kvactors_ipc")}
            assert got["kvactors_ipc_owners_opened_total"] == 2.0
            assert got["kvactors_ipc_owners_closed_total"] == 1.0
            rt.close_ipc_context(2)
    finally:
        shared.close()
