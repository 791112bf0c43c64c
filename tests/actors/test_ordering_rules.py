"""Design rules 1-3 against ManualBackend, whose device runs only when the test releases it.

Each test fails when its rule is broken: publishing a record without the stream sync makes
rule 1's record drainable while device work is still queued; handing the lane's lease back
before the marker completes lets ManualBackend's weak-referenced queue lose the work (rule
3); closing an IPC owner before the stream sync is recorded as a close under queued work
(rule 2). The tests wait for states on ManualBackend's condition variable, never on time.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.actors.directory import StreamDirectory
from kvactors.actors.ipc_owner import IPCOwnerActor
from kvactors.actors.outbox import Outbox
from kvactors.actors.stream import Work
from kvactors.core.protocols.ipc import CloseContext, OpenHandle
from kvactors.core.protocols.stream import (
    EventRecord,
    Launch,
    Launched,
    RecordCompletion,
    RecordEvent,
    Sync,
    Synced,
)
from kvactors.errors import IPCError, TransferFailedError
from kvactors.testing.manual import ManualBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.devices.base import IPCHandle, IPCOwner, StreamLike


def _directory(backend: ManualBackend) -> StreamDirectory:
    return StreamDirectory(
        backend=backend,
        index=0,
        completions=Outbox(),
        events=Outbox(),
        capacity=64,
        stop_timeout=5.0,
    )


async def _until(backend: ManualBackend, pred: object) -> None:
    ok = await asyncio.to_thread(backend.wait_for, pred, 10.0)  # type: ignore[arg-type]
    assert ok, "state not reached"


async def test_rule1_record_published_only_after_stream_ran() -> None:
    backend = ManualBackend()
    streams = _directory(backend)
    stream = streams.get(0)
    out = torch.zeros(4)
    launched = stream.ask_nowait(Launch(transfer_id=1, nbytes=16), Work(lambda: out.fill_(7)))  # type: ignore[arg-type]
    recorded = stream.ask_nowait(RecordCompletion(kind="finish", payload=b"p1"))
    # The lane launched the work and now blocks in the stream sync behind it.
    await _until(backend, lambda b: b.queued(0) == 1 and b.sync_waiters >= 1)
    assert streams.completions.drain() == []
    assert not recorded.done()
    backend.release()
    await recorded
    assert await launched == Launched(transfer_id=1, nbytes=16)
    assert streams.completions.drain() == [("finish", b"p1")]
    assert torch.equal(out, torch.full((4,), 7.0))
    await streams.stop(timeout=5.0)


async def test_rule1_handle_streams_are_independent_and_records_keep_submission_order() -> None:
    backend = ManualBackend()
    streams = _directory(backend)
    slow, fast = streams.get(0), streams.get(17)
    slow.ask_nowait(Launch(transfer_id=1), Work(lambda: None))
    first = slow.ask_nowait(RecordEvent(record=_event("a")))
    second = fast.ask_nowait(RecordEvent(record=_event("b")))
    await second  # stream 17 had no work: its record is published at once
    # ...but it is not drainable before the earlier record of the slow stream.
    assert streams.events.drain() == []
    await _until(backend, lambda b: b.sync_waiters >= 1)
    backend.release()
    await first
    assert [r.event_type for r in streams.events.drain()] == ["a", "b"]
    await streams.stop(timeout=5.0)


async def test_sync_barrier_waits_for_earlier_work() -> None:
    backend = ManualBackend()
    streams = _directory(backend)
    stream = streams.get(0)
    for i in range(3):
        stream.ask_nowait(Launch(transfer_id=i), Work(lambda: None))
    synced = stream.ask_nowait(Sync())
    await _until(backend, lambda b: b.queued(0) == 3 and b.sync_waiters >= 1)
    assert not synced.done()
    backend.release(2)
    await _until(backend, lambda b: b.queued(0) == 1)
    assert not synced.done()
    backend.release()
    result = await synced
    assert isinstance(result, Synced)
    await streams.stop(timeout=5.0)


async def test_rule3_operands_owned_until_device_completed() -> None:
    backend = ManualBackend()
    streams = _directory(backend)
    stream = streams.get(0)
    dst = torch.zeros(8)
    src = torch.arange(8, dtype=torch.float32)
    src_ref = weakref.ref(src)

    def copy(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
        dst.copy_(src)

    launched = stream.ask_nowait(Launch(transfer_id=5), Work(copy))
    del copy, src
    await _until(backend, lambda b: b.queued(0) == 1)
    gc.collect()
    assert src_ref() is not None, "operand dropped while the device still had the copy queued"
    backend.release()
    await launched
    assert backend.use_after_free == 0
    assert torch.equal(dst, torch.arange(8, dtype=torch.float32))
    await streams.stop(timeout=5.0)
    gc.collect()
    assert src_ref() is None, "operand leaked after the copy completed"


class _LaunchFailsAfterEnqueue(ManualBackend):
    """A device whose launch enqueued work and then failed (an allocation failing between
    two copies of one kernel, say): the enqueued part still runs on the stream."""

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        super().launch(stream, fn)
        raise RuntimeError("launch failed after enqueueing work")


async def test_rule3_failed_launch_keeps_operands_until_the_stream_ran_what_it_enqueued() -> None:
    backend = _LaunchFailsAfterEnqueue()
    streams = _directory(backend)
    stream = streams.get(0)
    dst = torch.zeros(8)
    src = torch.arange(8, dtype=torch.float32)
    src_ref = weakref.ref(src)

    def copy(dst: torch.Tensor = dst, src: torch.Tensor = src) -> None:
        dst.copy_(src)

    launched = stream.ask_nowait(Launch(transfer_id=6), Work(copy))
    del copy, src
    # The lane handles the failure by watching the stream past the enqueued work (its reaper
    # waits in the stream sync); a lane that gave the lease back at once never gets there.
    watched = await asyncio.to_thread(
        backend.wait_for, lambda b: b.queued(0) == 1 and b.sync_waiters >= 1, 10.0
    )
    assert watched, "the failed launch was answered without waiting for the work it enqueued"
    gc.collect()
    assert src_ref() is not None, "operand dropped while a failed launch's work was queued"
    assert not launched.done(), "a failed launch was reported before its enqueued work ran"
    backend.release()
    with pytest.raises(TransferFailedError, match="launch failed after enqueueing work"):
        await launched
    assert backend.use_after_free == 0
    assert torch.equal(dst, torch.arange(8, dtype=torch.float32))
    await streams.stop(timeout=5.0)


async def test_rule2_ipc_owner_closed_only_after_stream_sync() -> None:
    backend = ManualBackend()
    streams = _directory(backend)
    ipc = IPCOwnerActor("ipc", backend=backend, streams=streams, capacity=16)
    ipc.start()
    shared = backend.alloc_shared((16,), torch.float32)
    try:
        assert shared.tensor is not None
        handle = backend.ipc_export(shared.tensor)
        _, view = await ipc.ask_nowait(OpenHandle(context_id=1, handle=handle))
        stream = streams.get(0)

        def write(view: torch.Tensor = view) -> None:
            view.fill_(3.0)

        stream.ask_nowait(Launch(transfer_id=1), Work(write))
        del write, view
        closing = ipc.ask_nowait(CloseContext(context_id=1, stream_handles=(0,)))
        await _until(backend, lambda b: b.sync_waiters >= 1)
        assert backend.owners_closed == 0
        backend.release()
        closed = await closing
        assert closed.owners_closed == 1
        assert backend.closed_under_work == 0
        assert torch.equal(shared.tensor, torch.full((16,), 3.0))
        again = await ipc.ask_nowait(CloseContext(context_id=1))
        assert again.owners_closed == 0  # idempotent
        assert ipc.open_owners == 0
    finally:
        await ipc.stop()
        await streams.stop(timeout=5.0)
        shared.close()


async def test_ipc_close_reports_live_view_and_still_forgets_context() -> None:
    backend = ManualBackend(auto=True)
    streams = _directory(backend)
    ipc = IPCOwnerActor("ipc", backend=backend, streams=streams, capacity=16)
    ipc.start()
    shared = backend.alloc_shared((4,), torch.float32)
    try:
        assert shared.tensor is not None
        _, view = await ipc.ask_nowait(
            OpenHandle(context_id=2, handle=backend.ipc_export(shared.tensor))
        )
        with pytest.raises(IPCError, match="live views"):
            await ipc.ask_nowait(CloseContext(context_id=2))
        del view
    finally:
        await ipc.stop()
        await streams.stop(timeout=5.0)
        shared.close()


class _UnmapFails(ManualBackend):
    """A backend whose IPC owners release their mapping, then report a foreign OS error."""

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        inner = super().ipc_open(handle)

        class Owner:
            tensor = property(lambda _self: inner.tensor)
            closed = property(lambda _self: inner.closed)

            def close(self) -> None:
                inner.close()
                raise OSError("munmap failed")

        return Owner()


async def test_ipc_close_translates_a_foreign_close_error_naming_the_context() -> None:
    backend = _UnmapFails(auto=True)
    streams = _directory(backend)
    ipc = IPCOwnerActor("ipc", backend=backend, streams=streams, capacity=16)
    ipc.start()
    shared = backend.alloc_shared((4,), torch.float32)
    try:
        assert shared.tensor is not None
        await ipc.ask_nowait(OpenHandle(context_id=7, handle=backend.ipc_export(shared.tensor)))
        with pytest.raises(IPCError, match="context 7 closed with errors") as info:
            await ipc.ask_nowait(CloseContext(context_id=7))
        assert isinstance(info.value.__cause__, OSError)
        assert ipc.open_owners == 0  # forgotten all the same
    finally:
        await ipc.stop()
        await streams.stop(timeout=5.0)
        shared.close()


def _event(kind: str) -> EventRecord:
    return EventRecord(event_type=kind, session_id="s", wall_ts=0.0, str_fields={}, int_fields={})
