"""Borrowed-stream actors are retired when idle, and close() loses no record.

Stream churn (1000 short-lived caller streams) must leave a small, fixed number of stream
actors and threads; ``Runtime.close()`` must publish or withdraw (and count) every record
still pending, never leave one neither. The tests wait for states, never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import torch

from kvactors.actors.actor import ActorState
from kvactors.actors.directory import StreamDirectory
from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.errors import DeviceOpError
from kvactors.runtime import Runtime
from kvactors.testing.manual import ManualBackend
from tests._device_actors import loop_of, started_actors

if TYPE_CHECKING:
    from kvactors.actors.stream import StreamActor


def _lane_threads(
    before: frozenset[threading.Thread] = frozenset(),
) -> list[threading.Thread]:
    """Lane and reaper threads alive now, but for those alive ``before`` (other tests' runtimes
    in this process are not this test's)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("lane:", "reap:")) and t not in before
    ]


def _max_idle() -> int:
    default = inspect.signature(StreamDirectory).parameters["max_idle"].default
    assert isinstance(default, int)
    return default


def _stream_actors(rt: Runtime) -> list[str]:
    # An actor that went idle tells the loop so; a round trip through an actor whose turns
    # run on the loop (closing an unknown IPC context answers at once) lets those notes land.
    rt.close_ipc_context(2**40)
    return [a.name for a in rt.statistics().actors if a.name.startswith("stream:")]


def test_stream_churn_leaves_a_small_fixed_number_of_actors_and_threads() -> None:
    before = frozenset(_lane_threads())
    keep = _max_idle()
    with Runtime("cpu") as rt:
        for handle in range(1, 1001):
            rt.record_completion(handle, "done", handle.to_bytes(2, "little"))
            rt.synchronize(handle)
        running = _stream_actors(rt)
        assert len(running) <= keep + 1  # handle 0 plus at most max_idle idle borrowed ones
        live = set(running)
        for t in _lane_threads(before):
            if t.name.split(":", 1)[1] not in live:
                t.join(10)  # a retired actor's lane ends once its stop ran
        assert len(_lane_threads(before)) <= 2 * (keep + 1)
        assert rt.statistics().streams_retired >= 1000 - keep
        # Retiring lost nothing: every record was published, in submission order.
        drained = rt.drain_completions()
        assert [int.from_bytes(p, "little") for _, p in drained] == list(range(1, 1001))


def test_a_retired_handle_gets_a_fresh_actor_that_keeps_working() -> None:
    with Runtime("cpu") as rt:
        for handle in range(1, _max_idle() + 3):
            rt.synchronize(handle)
        assert "stream:cpu:0:0x1" not in _stream_actors(rt)  # the oldest idle one retired
        rt.record_completion(1, "again", b"1")
        rt.synchronize(1)
        assert rt.drain_completions() == [("again", b"1")]


def _request() -> TransferRequest:
    shape = ShapeDesc(kv_size=2, nl=1, nb=4, bs=2, nh=1, hs=4, element_size=2, dtype="bfloat16")
    return TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(Direction.D2H),
        block_ids=(1,),
        chunk_size=2,
        shape=shape,
    )


def _blocked_store(backend: ManualBackend, rt: Runtime) -> threading.Thread:
    paged = [torch.zeros(2, 4, 2, 1, 4, dtype=torch.bfloat16)]
    objs = [torch.zeros(2, 1, 2, 4, dtype=torch.bfloat16)]

    def caller() -> None:
        with contextlib.suppress(Exception):  # failed by the close: the records matter here
            rt.transfer(_request(), paged, objs, timeout=30)

    t = threading.Thread(target=caller)
    t.start()
    assert backend.wait_for(lambda b: b.queued() == 1)
    return t


def test_close_withdraws_and_counts_records_it_cannot_publish() -> None:
    backend = ManualBackend()
    rt = Runtime(backend, stop_timeout=0.2).start()
    rt.record_completion(0, "early", b"0")
    t = _blocked_store(backend, rt)
    rt.record_completion(0, "late", b"1")  # behind device work that never ran
    rt.record_completion(0, "later", b"2")
    with pytest.raises(DeviceOpError, match="did not end"):  # the stuck lane is abandoned
        rt.close(timeout=0.2)
    t.join(10)
    assert rt.drain_completions() == [("early", b"0")]
    assert rt.records_withdrawn == 2  # published or withdrawn: none is lost silently
    backend.release()  # the abandoned lane may now reach its publish: it must not publish
    assert backend.wait_for(lambda b: b.queued() == 0)
    assert rt.drain_completions() == []


def test_records_published_by_the_close_stay_drainable_after_it() -> None:
    backend = ManualBackend()
    rt = Runtime(backend, stop_timeout=10.0).start()
    t = _blocked_store(backend, rt)
    rt.record_completion(0, "after-store", b"1")
    releaser = threading.Thread(
        target=lambda: backend.wait_for(lambda b: b.sync_waiters > 0) and backend.release()
    )
    releaser.start()
    rt.close()
    t.join(10)
    releaser.join(10)
    assert rt.drain_completions() == [("after-store", b"1")]
    assert rt.records_withdrawn == 0


def test_a_lane_abandoned_by_a_timed_out_stop_ends_with_its_reaper_once_unblocked() -> None:
    """``Lane.stop`` gives up on a lane whose job hangs (a device that stopped answering);
    when the job returns after all, the lane ends and takes its reaper thread with it (none
    is left waiting forever)."""
    from kvactors.actors.lane import Lane
    from kvactors.devices.cpu import CpuBackend

    backend = CpuBackend()
    lane = Lane("abandoned", backend, 0, backend.stream_from_handle(0, 0))
    lane.start()
    unblock = threading.Event()

    def hung_job() -> None:
        unblock.wait(30)

    lane.submit(hung_job)
    assert lane.stop(timeout=0.01) is False  # the job still runs: abandoned
    unblock.set()
    threads = [t for t in threading.enumerate() if t.name.endswith(":abandoned")]
    assert len(threads) == 2  # the lane and its reaper
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a thread of the abandoned lane never ended"


@pytest.mark.parametrize("call", ["record_completion", "synchronize"])
def test_a_call_that_races_its_stream_actors_retirement_is_served_by_the_next_actor(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory retires a borrowed stream's idle actor right between a call's lookup and
    its send (the actor refuses: nothing ran): the call goes to the handle's new actor."""
    started = started_actors(monkeypatch)
    with Runtime("cpu") as rt:
        rt.synchronize(1)  # handle 1 has an actor, idle
        (actors,) = started
        loop = loop_of(actors)
        streams = actors.streams
        lookup = streams.get
        raced: list[StreamActor] = []

        def get(handle: int) -> StreamActor:
            actor = lookup(handle)
            if handle == 1 and not raced:
                raced.append(actor)

                async def retire() -> None:
                    streams._retire(1)

                asyncio.run_coroutine_threadsafe(retire(), loop).result(10)
            return actor

        streams.get = get  # type: ignore[method-assign]
        if call == "record_completion":
            rt.record_completion(1, "done", b"1")
        rt.synchronize(1)
        assert raced, "the call never looked its stream up"
        assert raced[0].state is not ActorState.RUNNING, "the race did not happen"
        if call == "record_completion":
            assert rt.drain_completions() == [("done", b"1")]


class _SyncLog(ManualBackend):
    """ManualBackend logging every stream synchronize by handle."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: list[int] = []

    def synchronize(self, stream: Any) -> None:
        self.synced.append(self.stream_handle(stream))
        super().synchronize(stream)


def test_a_record_never_touches_a_borrowed_stream_after_its_call_returned() -> None:
    """A record on a borrowed stream (nonzero handle) marks the stream inside the call; it is
    published once that marker and the copy queued before it completed, and kvactors never
    synchronizes the caller's stream (which the caller may destroy once the call returned)."""
    backend = _SyncLog()
    with Runtime(backend) as rt:
        paged = [torch.zeros(2, 4, 2, 1, 4, dtype=torch.bfloat16)]
        objs = [torch.ones(2, 1, 2, 4, dtype=torch.bfloat16)]
        req = msgspec.structs.replace(_request(), direction=int(Direction.H2D))
        rt.transfer(req, paged, objs, stream_handle=5, complete=False)
        rt.record_completion(5, "stored", b"1")
        assert backend.queued(5) == 1  # the copy has not run: the record must wait for it
        assert rt.drain_completions() == []
        backend.release(stream_handle=5)
        drained: list[tuple[str, bytes]] = []
        end = time.monotonic() + 10  # bounds a wait only a hang would exhaust
        while not drained and time.monotonic() < end:
            drained = rt.drain_completions()
            backend.wait_for(lambda b: True, 0.001)
        assert drained == [("stored", b"1")]
        assert torch.equal(paged[0][:, 1], torch.ones(2, 2, 1, 4, dtype=torch.bfloat16))
        assert 5 not in backend.synced, "kvactors synchronized the caller's stream itself"
