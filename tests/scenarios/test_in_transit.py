"""Messages in transit: an ``a*`` call made before a blocking ``transfer`` by the same thread
is ordered before it, even when the blocking call could run inline on the caller's thread.

``Runtime.transfer`` runs inline only while no message of the runtime is in transit, that is,
sent with ``call_soon_threadsafe`` and not yet in its actor's mailbox. These tests make "in
transit" certain instead of likely: the earlier message is held on the event loop inside its
own delivery (the backend's ``prepare_transfer`` blocks on a gate, on the loop thread, before
the message reached the lane), and the gate opens only once the later call either returned
(it ran inline: the rule is broken) or handed its message to the loop (it queued behind the
held one: the rule holds). The second condition is observed on the runtime's own event loop,
built by an asyncio event-loop policy installed only while the runtime starts; its
``call_soon_threadsafe`` opens the gate for the one thread that armed it. No sleeps, no
timeouts that decide the outcome: each case fails on the data (the program-order result
against the overtaken one) when the ``not self._in_transit`` condition of ``Runtime.transfer``
is removed, or when ``_arrived`` is counted before the message reached the mailbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any, TypeVarTuple, Unpack

import torch

from kvactors.devices.cpu import CpuBackend
from kvactors.layouts import Direction
from kvactors.runtime import Runtime
from tests.scenarios import _kv

if TYPE_CHECKING:
    import contextvars
    from collections.abc import Callable, Iterator, Sequence

    from kvactors.plans import TransferRequest

_Ts = TypeVarTuple("_Ts")
_WAIT = 10.0  # bounds a wait that only a hang would exhaust; never decides a result


class _HeldCpu(CpuBackend):
    """The CPU backend (work complete when launched, so the runtime runs idle blocking calls
    inline), whose next ``prepare_transfer`` waits for a gate: it runs on the event loop while
    the GatherActor handles the transfer, so that message is in transit until the gate opens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()
        self._hold = False

    def hold_next(self) -> None:
        self._hold = True

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        if self._hold:
            self._hold = False
            self.entered.set()
            assert self.gate.wait(_WAIT), "the held transfer was never released"
        return super().prepare_transfer(request, paged, objects)


class _WatchedLoop(asyncio.SelectorEventLoop):
    """The runtime's loop; ``call_soon_threadsafe`` from the armed thread runs a hook after the
    callback is queued (that thread's message is then submitted to the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self._armed: tuple[int, Callable[[], None]] | None = None

    @contextlib.contextmanager
    def on_submit(self, hook: Callable[[], None]) -> Iterator[None]:
        self._armed = (threading.get_ident(), hook)
        try:
            yield
        finally:
            self._armed = None

    def call_soon_threadsafe(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: Unpack[_Ts],
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        handle = super().call_soon_threadsafe(callback, *args, context=context)
        armed = self._armed
        if armed is not None and armed[0] == threading.get_ident():
            self._armed = None
            armed[1]()
        return handle


@contextlib.contextmanager
def _runtime(backend: _HeldCpu) -> Iterator[tuple[Runtime, _WatchedLoop]]:
    loops: list[_WatchedLoop] = []

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            loop = _WatchedLoop()
            loops.append(loop)
            return loop

    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(Policy())
    try:
        rt = Runtime(backend).start()
    finally:
        asyncio.set_event_loop_policy(previous)
    try:
        assert rt.inline, "the CPU runtime must run idle blocking transfers inline"
        assert len(loops) == 1
        yield rt, loops[0]
    finally:
        backend.gate.set()  # never leave the loop blocked, even when a check failed
        rt.close()


def _blocking_after_held(
    backend: _HeldCpu, loop: _WatchedLoop, call: Callable[[], object]
) -> object:
    """Run ``call`` (a blocking transfer) while the earlier transfer is held in transit;
    open the gate once ``call`` queued its message (rule kept) or returned (rule broken)."""
    assert backend.entered.wait(_WAIT), "the earlier transfer never reached the loop"
    with loop.on_submit(backend.gate.set):
        result = call()
    backend.gate.set()  # ran inline: nothing was queued, so the hook never fired
    return result


def _chunk(fill: float) -> list[torch.Tensor]:
    return _kv.objects(1, fill)


def _blocks(paged: list[torch.Tensor], ids: tuple[int, ...]) -> torch.Tensor:
    return torch.stack([layer[:, list(ids)] for layer in paged])


IDS = (3, 5)


async def test_atransfer_then_inline_transfer_to_the_same_blocks_lands_in_program_order() -> None:
    backend = _HeldCpu()
    with _runtime(backend) as (rt, loop):
        paged = _kv.paged(1)
        scatter = _kv.request(Direction.H2D, IDS)
        backend.hold_next()
        first = rt.atransfer(scatter, paged, _chunk(1.0))
        _blocking_after_held(backend, loop, lambda: rt.transfer(scatter, paged, _chunk(2.0)))
        await first
        got = _blocks(paged, IDS)
        program_order = torch.equal(got, torch.full_like(got, 2.0))
        assert program_order, (
            "the earlier atransfer landed after the later blocking transfer (stale KV): "
            f"blocks hold {got.unique().tolist()}"
        )


async def test_inline_gather_reads_what_an_earlier_atransfer_scattered() -> None:
    backend = _HeldCpu()
    with _runtime(backend) as (rt, loop):
        paged = [torch.zeros_like(t) for t in _kv.paged(1)]
        backend.hold_next()
        first = rt.atransfer(_kv.request(Direction.H2D, IDS), paged, _chunk(7.0))
        out = _chunk(-1.0)
        gather = _kv.request(Direction.D2H, IDS)
        _blocking_after_held(backend, loop, lambda: rt.transfer(gather, paged, out))
        await first
        read_after_write = torch.equal(out[0], torch.full_like(out[0], 7.0))
        assert read_after_write, (
            "the later gather read the blocks before the earlier-issued scatter wrote them: "
            f"chunk holds {out[0].unique().tolist()}"
        )


async def test_store_fence_then_inline_reuse_keeps_the_stored_kv() -> None:
    # The serving pattern: store blocks (atransfer D2H), fence them, then reuse them for new
    # KV (a blocking scatter). The store must capture the old KV, never the new.
    backend = _HeldCpu()
    with _runtime(backend) as (rt, loop):
        paged = _kv.paged(4)
        old = _blocks(paged, IDS).clone()
        stored = _chunk(-1.0)
        backend.hold_next()
        store = rt.atransfer(_kv.request(Direction.D2H, IDS), paged, stored)
        fence = rt.afence(IDS)
        reuse = _kv.request(Direction.H2D, IDS)
        _blocking_after_held(backend, loop, lambda: rt.transfer(reuse, paged, _chunk(9.0)))
        await store
        await fence
        want = _kv.expected_gather([t.clone() for t in _kv.paged(4)], IDS)
        old_kv = _kv.same(stored[0], want[0])
        assert old_kv, "the store captured KV written by a scatter issued after it and its fence"
        new = _blocks(paged, IDS)
        assert torch.equal(new, torch.full_like(new, 9.0))
        assert not torch.equal(old, new)
