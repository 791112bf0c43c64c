"""Fault injection: stream errors, cancelled callers, shutdown in flight, killed IPC peers,
full mailboxes. Each scenario checks that nothing is lost and every failure is reported.

Device progress is driven by ManualBackend.release() (or by the fake vendors' own stream
threads); waits are on ManualBackend.wait_for, process joins and reply futures, never on
wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import threading
import weakref
from typing import Any

import pytest
import torch

from kvactors.actors.gather import TransferOperands
from kvactors.actors.group import DeviceActors
from kvactors.core.layouts import Direction
from kvactors.core.protocols.gather import Fence, Fenced, Ping, Pong, Transfer
from kvactors.devices.cpu import CpuBackend
from kvactors.errors import (
    ActorClosedError,
    DeviceOpError,
    KvactorsError,
    MailboxFullError,
    TransferAbandonedError,
    TransferFailedError,
)
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from kvactors.testing.manual import ManualBackend
from tests.scenarios import _doubles
from tests.scenarios._doubles import FaultyBackend, open_fds, shm_exists, shm_mappings
from tests.scenarios._kv import expected_gather, objects, paged, request, same

D2H, H2D = Direction.D2H, Direction.H2D


async def _until(backend: ManualBackend, pred: Any) -> None:
    assert await asyncio.to_thread(backend.wait_for, pred, 10.0), "state not reached"


def _pinned(objs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [o.pin_memory() for o in objs]


# ---- stream errors ------------------------------------------------------------------------


def test_stream_error_fails_the_transfer_and_other_streams_keep_flowing() -> None:
    """A sticky error on the fake MUSA default stream fails the transfer queued behind it
    (reported, its chunk never committed); a borrowed side stream keeps moving bit-exact
    data meanwhile; one synchronize reports and clears the error, and the stream recovers."""
    src_cpu = paged(11)
    committed: dict[str, torch.Tensor] = {}
    with fake_vendor("musa", seed=3) as fake:
        import torch_musa  # type: ignore[import-not-found]  # the fake

        src = [fake.adopt(t) for t in src_cpu]
        side = torch_musa.Stream()
        with Runtime("musa", default_timeout=30) as rt:
            fake.inject_error(fake.default_stream(0), "ECC error on stream 0")
            bad = _pinned(objects(1))
            with pytest.raises(KvactorsError, match="ECC error on stream 0"):
                rt.transfer(request(D2H, [1, 2]), src, bad)
            # LMCache's rule: only a store reported done is committed.
            good = _pinned(objects(1))
            rt.transfer(request(D2H, [3, 4]), src, good, stream_handle=side.musa_stream)
            committed["side"] = good[0]
            with pytest.raises(DeviceOpError, match="ECC error on stream 0"):
                rt.synchronize(0)  # reports the sticky error once and clears it
            again = _pinned(objects(1))
            rt.transfer(request(D2H, [1, 2]), src, again)
            committed["retry"] = again[0]
            stats = rt.statistics()
        assert stats.transfers_failed == 1
        assert stats.transfers_ok == 2
        assert stats.inflight == 0
        assert same(committed["side"], expected_gather(src_cpu, [3, 4])[0])
        assert same(committed["retry"], expected_gather(src_cpu, [1, 2])[0])
        assert "bad" not in committed


async def test_device_error_is_reported_as_failure_and_others_complete() -> None:
    """The device reports an error for one launch: its ask fails with TransferFailedError,
    the fence on its blocks still answers, and the transfers around it complete bit-exact."""
    backend = FaultyBackend()
    src = paged(12)
    async with DeviceActors(backend) as dev:
        outs = [objects(1) for _ in range(3)]
        ids = [[0, 1], [2, 3], [4, 5]]
        asks = []
        for i, (o, b) in enumerate(zip(outs, ids, strict=True)):
            backend.fail_next = 1 if i == 1 else 0
            asks.append(
                dev.gather.ask_nowait(
                    Transfer(transfer_id=i, request=request(D2H, b)), TransferOperands(src, o)
                )
            )
            await _until(backend, lambda bk, n=i + 1: bk.queued() == n)
        fence = dev.gather.ask_nowait(Fence(block_ids=(2, 3)), timeout=10)
        backend.release()
        results = await asyncio.gather(*asks, return_exceptions=True)
        assert isinstance(results[1], TransferFailedError)
        assert "injected device error" in str(results[1])
        assert results[1].transfer_id == 1
        assert await fence == Fenced(block_ids=(2, 3), waited_for=1)
        for i in (0, 2):
            assert not isinstance(results[i], BaseException)
            assert same(outs[i][0], expected_gather(src, ids[i])[0])
        stats = dev.statistics()
        assert (stats.transfers_ok, stats.transfers_failed, stats.inflight) == (2, 1, 0)
    assert backend.use_after_free == 0


async def test_completed_marker_carrying_an_error_is_still_a_failure() -> None:
    backend = FaultyBackend(auto=True)  # work runs at launch: the marker is born complete
    src = paged(13)
    async with DeviceActors(backend) as dev:
        backend.fail_next = 1
        out = objects(1)
        with pytest.raises(TransferFailedError):
            await dev.gather.ask_nowait(
                Transfer(transfer_id=1, request=request(D2H, [0, 1])),
                TransferOperands(src, out),
                timeout=10,
            )


# ---- cancellation -------------------------------------------------------------------------


async def test_cancelled_caller_leaves_operands_owned_until_the_device_finished() -> None:
    backend = ManualBackend()
    src = paged(14)
    async with DeviceActors(backend) as dev:
        out = objects(1)
        out_ref = weakref.ref(out[0])

        async def caller(o: list[torch.Tensor]) -> Any:
            return await dev.gather.ask_nowait(
                Transfer(transfer_id=1, request=request(D2H, [6, 7])), TransferOperands(src, o)
            )

        task = asyncio.ensure_future(caller(out))
        del out
        await _until(backend, lambda b: b.queued() == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.collect()
        assert out_ref() is not None, "the chunk was dropped while the device had the copy"
        fence = dev.gather.ask_nowait(Fence(block_ids=(7,)), timeout=10)
        backend.release()
        assert (await fence).waited_for == 1  # the cancelled transfer still completed
        assert dev.statistics().transfers_ok == 1
    assert backend.use_after_free == 0
    gc.collect()
    assert out_ref() is None, "the chunk leaked after the copy completed"


async def _cancel_atransfer_in_flight(seed: int) -> None:
    backend = ManualBackend()
    src = paged(seed)
    with Runtime(backend) as rt:
        out = objects(1)
        task = asyncio.ensure_future(rt.atransfer(request(D2H, [2, 3]), src, out))
        await _until(backend, lambda b: b.queued() == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        del out
        backend.release()
        await asyncio.to_thread(rt.synchronize)
        assert (await rt.aping(3)).seq == 3
        assert rt.statistics().transfers_ok == 1  # the copy itself was not abandoned
    assert backend.use_after_free == 0


async def test_cancelled_atransfer_keeps_operands_and_the_runtime_works() -> None:
    await _cancel_atransfer_in_flight(15)


async def test_cancelled_atransfer_logs_no_error_on_the_runtime_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _cancel_atransfer_in_flight(19)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, caplog.text


# ---- shutdown -----------------------------------------------------------------------------


def test_shutdown_with_transfers_in_flight_is_bounded_and_fails_every_caller() -> None:
    backend = ManualBackend()
    src = paged(16)
    rt = Runtime(backend, stop_timeout=0.2).start()
    failures: list[BaseException] = []
    results: list[Any] = []

    def caller(i: int) -> None:
        try:
            results.append(rt.transfer(request(D2H, [i, i + 8]), src, objects(1), timeout=30))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert backend.wait_for(lambda b: b.queued() == 3)
    with pytest.raises(DeviceOpError, match="did not end"):  # the lane still waits on the device
        rt.close(timeout=0.2)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)  # bounded: every caller was answered
    assert results == []
    assert len(failures) == 3
    # All three were enqueued on the device: "may still land", never "not served".
    assert all(isinstance(f, TransferAbandonedError) for f in failures), failures
    backend.release()  # the abandoned device work may still run: its operands are alive
    assert backend.use_after_free == 0
    with pytest.raises(ActorClosedError):
        rt.ping()


async def test_stop_with_transfers_in_flight_leaves_no_ask_pending() -> None:
    backend = ManualBackend()
    src = paged(17)
    dev = DeviceActors(backend, stop_timeout=0.2)
    dev.start()
    asks = [
        dev.gather.ask_nowait(
            Transfer(transfer_id=i, request=request(D2H, [i])), TransferOperands(src, objects(1))
        )
        for i in range(4)
    ]
    fence = dev.gather.ask_nowait(Fence(block_ids=(0, 1, 2, 3)))
    await _until(backend, lambda b: b.queued() == 4)
    await dev.stop(timeout=0.2)
    pending = [a for a in [*asks, fence] if not a.done()]
    assert pending == [], "an ask was left pending after shutdown"
    for a in asks:  # enqueued on the device: they may still land
        assert isinstance(a.exception(), TransferAbandonedError)
    assert isinstance(fence.exception(), ActorClosedError)  # never answered: not served
    backend.release()
    assert backend.use_after_free == 0


# ---- killed IPC peers ---------------------------------------------------------------------


def _warm_up_process_singletons() -> None:
    # multiprocessing starts a resource-tracker process on first use and keeps a pipe to it
    # for the life of the process: start it before taking fd baselines, so only real leaks
    # show up as a difference.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _reap(proc: Any) -> None:
    if proc.is_alive():
        _doubles.kill(proc.pid)
    proc.join(30)
    proc.close()  # releases the process sentinel fd


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def test_exporter_killed_while_we_hold_its_mappings() -> None:
    """The worker that exported KV dies; our mappings stay valid until we close the
    context, and closing it reclaims every owner, mapping and fd."""
    numel = 1024
    _warm_up_process_singletons()
    with Runtime("cpu") as rt:
        rt.ping()
        maps0, fds0 = shm_mappings(), open_fds()
        proc, conn = _spawn(_doubles.exporter_child, 2, numel)
        try:
            handles = conn.recv()
            views = [rt.open_ipc(h, context_id=7) for h in handles]
            assert shm_mappings() == maps0 + 2
            _doubles.kill(proc.pid)
            proc.join(30)
            assert proc.exitcode == -9
            # The mappings outlive their exporter: read and write through them.
            for i, v in enumerate(views):
                assert bool((v == float(i + 1)).all())
                v.add_(1.0)
                assert bool((v == float(i + 2)).all())
            del v, views
            assert rt.statistics().ipc_owners_open == 2
            closed = rt.close_ipc_context(7)
            assert closed.owners_closed == 2
            assert rt.statistics().ipc_owners_open == 0
            assert shm_mappings() == maps0
        finally:
            conn.close()
            _reap(proc)
            for h in handles:  # the exporter died before unlinking: clean up after it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{h.name}")
                    from multiprocessing import resource_tracker

                    resource_tracker.unregister(f"/{h.name}", "shared_memory")
        assert open_fds() == fds0


def test_opener_killed_while_holding_our_mappings() -> None:
    """The peer that opened our segments dies holding them; our exporter still unlinks its
    segments, and our own mappings and fds return to where they were."""
    backend = CpuBackend()
    _warm_up_process_singletons()
    maps0, fds0 = shm_mappings(), open_fds()
    shared = [backend.alloc_shared((256,), torch.float32) for _ in range(2)]
    names = [s.name for s in shared]
    handles = [backend.ipc_export(s.tensor) for s in shared]  # type: ignore[arg-type]
    proc, conn = _spawn(_doubles.opener_child, handles)
    try:
        assert conn.recv() >= 2  # the peer maps both segments
        assert all(bool((s.tensor == 1.0).all()) for s in shared)  # type: ignore[union-attr]  # and wrote through them
        _doubles.kill(proc.pid)
        proc.join(30)
        assert proc.exitcode == -9
    finally:
        conn.close()
        _reap(proc)
        for s in shared:
            s.close()
    assert not any(shm_exists(n) for n in names)
    assert shm_mappings() == maps0
    assert open_fds() == fds0


# ---- backpressure -------------------------------------------------------------------------


async def test_full_mailbox_backpressure() -> None:
    """Nowait sends raise MailboxFullError and queue nothing; ``tell`` waits for space; every
    accepted message is handled: nothing is dropped."""
    backend = ManualBackend()
    src = paged(18)
    async with DeviceActors(backend, capacity=3) as dev:
        outs = [objects(1) for _ in range(3)]
        asks = [
            dev.gather.ask_nowait(
                Transfer(transfer_id=i, request=request(D2H, [i, i + 4])),
                TransferOperands(src, outs[i]),
            )
            for i in range(3)
        ]
        await _until(backend, lambda b: b.queued() == 3)
        processed = dev.gather.statistics().processed
        with pytest.raises(MailboxFullError):
            dev.gather.ask_nowait(Ping(seq=1))
        with pytest.raises(MailboxFullError):
            dev.gather.tell_nowait(Ping(seq=2))
        assert dev.gather.statistics().processed == processed  # nothing was queued
        waiting = asyncio.ensure_future(dev.gather.tell(Ping(seq=3)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done(), "tell must wait for space, not drop or fail"
        backend.release(1)
        await asyncio.wait_for(waiting, 10)
        backend.release()
        done = await asyncio.gather(*asks)
        assert [d.transfer_id for d in done] == [0, 1, 2]
        assert await dev.gather.ask_nowait(Ping(seq=4)) == Pong(seq=4)
        stats = dev.gather.statistics()
        assert stats.processed == processed + 2  # the waited tell and the last ask
        assert stats.mailbox_peak == 3
        for i in range(3):
            assert same(outs[i][0], expected_gather(src, [i, i + 4])[0])
    assert backend.use_after_free == 0
