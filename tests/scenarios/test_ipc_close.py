"""IPC close after sync (rule 2), on ManualBackend: device work runs only when released.

A view opened into an IPC context may be used on any stream, not only the streams the closer
names; and two closes of one context may overlap. Both cases must close the owners only after
every stream that may have used the views ran its queued work, and no close may answer before
the owners are closed. Progress is stepped with ``release()``; waits are on ManualBackend's
condition variable (``wait_for``) and on reply futures, never on wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.actors.directory import StreamDirectory
from kvactors.actors.ipc_owner import IPCOwnerActor
from kvactors.actors.outbox import Outbox
from kvactors.actors.stream import Work
from kvactors.core.layouts import Direction
from kvactors.core.protocols.ipc import CloseContext, ContextClosed, Opened, OpenHandle
from kvactors.core.protocols.stream import Launch
from kvactors.devices.musa.backend import MusaBackend
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from kvactors.testing.manual import ManualBackend
from tests._device_actors import started_actors
from tests.scenarios._kv import BS, CHUNK, DTYPE, HS, NB, NH, expected_gather, request, same, shape

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from kvactors.actors.group import DeviceActors
    from kvactors.actors.reply import Reply

_WAIT = 10.0  # bounds a wait only a hang would exhaust; never decides a result


class _Rig:
    def __init__(self) -> None:
        self.backend = ManualBackend()
        self.streams = StreamDirectory(
            backend=self.backend,
            index=0,
            completions=Outbox(),
            events=Outbox(),
            capacity=64,
            stop_timeout=5,
        )
        self.ipc = IPCOwnerActor("ipc", backend=self.backend, streams=self.streams, capacity=16)
        self.shared: list[Any] = []

    async def open(self, ctx: int) -> torch.Tensor:
        seg = self.backend.alloc_shared((16,), torch.float32)
        self.shared.append(seg)
        assert seg.tensor is not None
        opened, view = await self.ipc.ask_nowait(
            OpenHandle(context_id=ctx, handle=self.backend.ipc_export(seg.tensor))
        )
        assert isinstance(opened, Opened)
        return view  # type: ignore[no-any-return]

    def use_on(self, handle: int, view: torch.Tensor) -> Reply[Any]:
        """Queue device work that writes through ``view`` on stream ``handle`` (not run yet)."""
        stream = self.streams.get(handle)

        def write() -> None:
            view.fill_(3.0)

        return stream.ask_nowait(Launch(transfer_id=handle), Work(write))

    async def wait(self, predicate: Any) -> bool:
        return await asyncio.to_thread(self.backend.wait_for, predicate, 10.0)


@pytest.fixture
async def rig() -> AsyncIterator[_Rig]:
    r = _Rig()
    r.ipc.start()
    try:
        yield r
    finally:
        r.backend.release()
        await r.ipc.stop()
        await r.streams.stop(timeout=5)
        for seg in r.shared:
            seg.close()


async def test_close_syncs_a_stream_the_caller_did_not_name(rig: _Rig) -> None:
    """Work through the view sits on stream 17; the close names only the default stream."""
    view = await rig.open(1)
    launched = rig.use_on(17, view)
    del view
    assert await rig.wait(lambda m: m.queued(17) == 1)
    close = rig.ipc.ask_nowait(CloseContext(context_id=1, stream_handles=(0,)))
    # Fixed: the close's barrier on stream 17 blocks (the launch's reaper is the other
    # waiter). Broken: stream 0 syncs at once and the owner is closed under the queued work.
    await rig.wait(lambda m: m.owners_closed >= 1 or m.sync_waiters >= 2)
    assert rig.backend.owners_closed == 0, "owner closed while stream 17 still had work"
    assert not close.done()
    rig.backend.release()
    await launched
    assert await close == ContextClosed(context_id=1, owners_closed=1)
    assert rig.backend.closed_under_work == 0
    assert rig.ipc.open_owners == 0


async def test_second_close_waits_for_the_first(rig: _Rig) -> None:
    """A close sent while another close of the context waits on its barrier must not answer
    "closed 0" while the owner is still open: it waits and gets the first close's answer."""
    view = await rig.open(1)
    launched = rig.use_on(0, view)
    del view
    assert await rig.wait(lambda m: m.queued(0) == 1)
    first = rig.ipc.ask_nowait(CloseContext(context_id=1))
    assert await rig.wait(lambda m: m.sync_waiters >= 2)
    second = rig.ipc.ask_nowait(CloseContext(context_id=1))
    # A later message on the same mailbox: once it is answered, the second close was handled.
    await rig.open(2)
    assert not second.done(), f"second close answered {second.result()!r} before the first"
    assert rig.backend.owners_closed == 0
    rig.backend.release()
    await launched
    want = ContextClosed(context_id=1, owners_closed=1)
    assert await first == want
    assert await second == want
    assert rig.backend.closed_under_work == 0
    # Once closed, a further close is a no-op answered at once.
    assert await rig.ipc.ask_nowait(CloseContext(context_id=1)) == ContextClosed(
        context_id=1, owners_closed=0
    )


class _HeldMusa(MusaBackend):  # type: ignore[misc]
    """The real MUSA backend over the fake, whose next transfer is held in its GatherActor
    turn (``arm``), and whose kernels note whether an IPC owner was closed when they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered, self.hold = threading.Event(), threading.Event()
        self.ran_after_close: list[bool] = []
        self.closed = 0

    def prepare_transfer(self, request: Any, paged: Any, objects: Any) -> Any:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.hold.wait(_WAIT)
        return super().prepare_transfer(request, paged, objects)

    def transfer_kernel(self, plan: Any, paged: Any, objects: Any, torch_kernel: Any) -> Any:
        kernel = super().transfer_kernel(plan, paged, objects, torch_kernel)

        def run() -> None:
            self.ran_after_close.append(self.closed > 0)
            kernel()

        return run


def test_close_waits_for_a_transfer_queued_at_the_gather_actor_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 2 across actors: a transfer reading the context's view, submitted (``atransfer``)
    before the close while another caller holds the GatherActor's turn, runs before the
    owner is closed; the close answers after it."""
    one = shape(nl=1)
    layer = (2, NB, BS, NH, HS)

    def out() -> list[torch.Tensor]:
        return [torch.full((2, 1, CHUNK, NH * HS), -1.0, dtype=DTYPE)]

    started = started_actors(monkeypatch)
    with fake_vendor("musa", seed=2) as fake:
        backend = _HeldMusa()
        with Runtime(backend) as rt:
            source = torch.randn(layer).to(DTYPE)
            exported = fake.to_device(source.clone())  # the exporter keeps it alive
            view = rt.open_ipc(backend.ipc_export(exported), context_id=1)
            (actors,) = started
            owner = next(iter(actors.ipc._owners[1].values()))
            close = owner.close

            def counted_close() -> None:
                backend.closed += 1
                close()

            owner.close = counted_close  # type: ignore[method-assign]
            own = fake.to_device(torch.zeros(layer, dtype=DTYPE))
            backend.armed = True
            holder = threading.Thread(
                target=lambda: rt.transfer(request(Direction.D2H, (0, 1), shape=one), [own], out())
            )
            holder.start()
            try:
                assert backend.entered.wait(_WAIT), "the first transfer never took its turn"
                got = out()
                reply = rt.atransfer(request(Direction.D2H, (2, 3), shape=one), [view], got)
                del view
                closer = threading.Thread(target=rt.close_ipc_context, args=(1,))
                closer.start()
                _until_queued(rt, closer)
            finally:
                backend.hold.set()
            holder.join(_WAIT)
            closer.join(_WAIT)
            assert not closer.is_alive(), "close_ipc_context never returned"
            assert reply.wait(_WAIT, "Transfer").blocks == 2  # type: ignore[attr-defined]
            assert backend.closed == 1
            assert len(backend.ran_after_close) == 2, backend.ran_after_close  # A, then T2
            assert not any(backend.ran_after_close), "a transfer ran on a closed owner"
            want = expected_gather([source, source], (2, 3))[0][:, :1]
            assert same(got[0], want)


def _until_queued(rt: Runtime, closer: threading.Thread) -> None:
    # The close's first message queued at the GatherActor (behind the held turn and the
    # atransfer), or the close already reached the IPC actor (an unordered close).
    def queued() -> bool:
        gather = next(a for a in rt.statistics().actors if a.name.startswith("gather:"))
        ipc = next(a for a in rt.statistics().actors if a.name.startswith("ipc:"))
        return gather.mailbox_depth >= 2 or ipc.processed > 1 or not closer.is_alive()

    end = time.monotonic() + _WAIT
    while not queued():
        assert time.monotonic() < end, "the close never queued"
        closer.join(0.001)


class _RetiredCopy:
    """A plain call's copy reading an IPC view on a borrowed stream ``h1``, whose actor the
    directory then retired: the call returned once the copy was enqueued, the actor held
    nothing but its lane's watched lease, and more than ``max_idle`` borrowed streams went
    idle after it. The fake runs every work item ``delay`` seconds late, so the copy lands
    well after everything else here."""

    def __init__(self, fake: Any, rt: Runtime, backend: MusaBackend, actors: DeviceActors) -> None:
        layer = (2, NB, BS, NH, HS)
        source = torch.randn(layer).to(DTYPE)
        self.exported = fake.to_device(source.clone())  # the exporter keeps it alive
        view = rt.open_ipc(backend.ipc_export(self.exported), context_id=1)
        self.owner = next(iter(actors.ipc._owners[1].values()))
        # Pinned (the fake pins): a D2H into pageable memory blocks its caller.
        self.got = [torch.full((2, 1, CHUNK, NH * HS), -1.0, dtype=DTYPE).pin_memory()]
        self.want = expected_gather([source, source], (2, 3))[0][:, :1]
        h1 = torch.musa.Stream().musa_stream  # type: ignore[attr-defined]
        rt.synchronize(h1)  # h1's actor exists: the transfer below is a plain call
        rt.transfer(
            request(Direction.D2H, (2, 3), shape=shape(nl=1)),
            [view],
            self.got,
            stream_handle=h1,
            complete=False,
        )
        del view
        max_idle = inspect.signature(StreamDirectory).parameters["max_idle"].default
        for _ in range(max_idle):
            rt.synchronize(torch.musa.Stream().musa_stream)  # type: ignore[attr-defined]
        # A round trip through the IPC actor (on the loop) lets the idle notes land.
        rt.close_ipc_context(2**40)
        assert actors.streams.peek(h1) is None, "setup: h1's actor was not retired"
        assert not self.landed(), "setup: the copy landed before the retirement"

    def landed(self) -> bool:
        return same(self.got[0], self.want)


def test_close_waits_for_the_copy_of_a_retired_borrowed_stream_actor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 2 across a retirement (audit H1): a close of the context waits for the copy a
    retired stream actor's lane still watches, although no running actor knows that stream."""
    with fake_vendor("musa", delay=1.0) as fake:
        import torch_musa  # noqa: F401  (the fake)

        backend = MusaBackend()
        started = started_actors(monkeypatch)
        with Runtime(backend) as rt:
            case = _RetiredCopy(fake, rt, backend, *started)
            landed_at_close: list[bool] = []
            close = case.owner.close

            def checked_close() -> None:
                landed_at_close.append(case.landed())
                close()

            case.owner.close = checked_close  # type: ignore[method-assign]
            rt.close_ipc_context(1)
            assert landed_at_close == [True], "the owner closed under the retired stream's copy"


def test_retiring_an_actor_whose_lane_watches_a_copy_abandons_no_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retirement is housekeeping on a healthy device: a retired actor's stop waits for the
    copy its lane watches, however short the stop timeout, so the lane is never abandoned
    and ``Runtime.close`` does not raise."""
    with fake_vendor("musa", delay=1.0) as fake:
        import torch_musa  # noqa: F401  (the fake)

        backend = MusaBackend()
        started = started_actors(monkeypatch)
        rt = Runtime(backend, stop_timeout=0.3).start()  # shorter than the copy
        try:
            case = _RetiredCopy(fake, rt, backend, *started)
            rt.fence([2, 3])
            assert case.landed()
        finally:
            rt.close()  # raises if a lane was abandoned
        assert rt.statistics().lanes_abandoned == 0
