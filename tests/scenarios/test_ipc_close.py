"""IPC close after sync (rule 2), on ManualBackend: device work runs only when released.

A view opened into an IPC context may be used on any stream, not only the streams the closer
names; and two closes of one context may overlap. Both cases must close the owners only after
every stream that may have used the views ran its queued work, and no close may answer before
the owners are closed. Progress is stepped with ``release()``; waits are on ManualBackend's
condition variable (``wait_for``) and on reply futures, never on wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.actors.directory import StreamDirectory
from kvactors.actors.ipc_owner import IPCOwnerActor
from kvactors.actors.outbox import Outbox
from kvactors.actors.stream import Work
from kvactors.core.protocols.ipc import CloseContext, ContextClosed, Opened, OpenHandle
from kvactors.core.protocols.stream import Launch
from kvactors.testing.manual import ManualBackend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


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

    def use_on(self, handle: int, view: torch.Tensor) -> asyncio.Future[Any]:
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
