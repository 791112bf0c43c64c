"""Messages in transit: an ``a*`` call made before a blocking ``transfer`` by the same thread
is ordered before it, even when the blocking call could run inline on the caller's thread.

``Runtime.transfer`` runs inline only while no message of the runtime is in transit, that is,
sent with ``call_soon_threadsafe`` and not yet in its actor's mailbox. These tests make "in
transit" certain instead of likely: the earlier message is held on the event loop inside its
own delivery (the backend's ``prepare_transfer`` blocks on a gate, on the loop thread, while
the GatherActor handles the message, before it reached the lane), and the gate opens only
once the later call either returned (it ran inline: the rule is broken) or handed its
message to the loop (it queued behind the held one: the rule holds). The second condition is
observed on the runtime's own event loop, built by an asyncio event-loop policy installed
only while the runtime starts; its ``call_soon_threadsafe`` opens the gate for the one thread
that armed it. No sleeps, no timeouts that decide the outcome: each case fails on the data
(the program-order result against the overtaken one) when the ``not self._in_transit``
condition of ``Runtime.transfer`` is removed; the first two also when ``_arrived`` is counted
before the message reached the mailbox (in the third the fence behind the held store is
still in transit then).

On CPU the runtime runs idle blocking transfers inline by default. On the fake MLU and MUSA
(device work runs later, on the stream's thread) it does only when asked (``inline=True``);
the same order must hold there, on the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, TypeVarTuple, Unpack

import pytest
import torch

from kvactors.devices.base import Backend
from kvactors.devices.cpu import CpuBackend
from kvactors.devices.mlu.backend import MluBackend
from kvactors.devices.musa.backend import MusaBackend
from kvactors.layouts import Direction
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios import _kv

if TYPE_CHECKING:
    import contextvars
    from collections.abc import Callable, Iterator, Sequence

    from kvactors.plans import TransferRequest
    from kvactors.testing import FakeVendor

_Ts = TypeVarTuple("_Ts")
_WAIT = 10.0  # bounds a wait that only a hang would exhaust; never decides a result
IDS = (3, 5)
KINDS = ["cpu", "mlu", "musa"]


class _Gate:
    """Holds the next transfer the backend prepares (on the loop) until :meth:`open`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        self._armed = False

    def hold_next(self) -> None:
        self._armed = True

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        if self._armed:
            self._armed = False
            self.entered.set()
            assert self._open.wait(_WAIT), "the held transfer was never released"


class _Held(Backend):
    """A backend whose ``prepare_transfer`` passes its :class:`_Gate` first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = _Gate()

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        self.gate.pass_through()
        return super().prepare_transfer(request, paged, objects)


class _HeldCpu(_Held, CpuBackend):
    """Work complete when launched: the runtime runs idle blocking transfers inline."""


class _HeldMlu(_Held, MluBackend):
    pass


class _HeldMusa(_Held, MusaBackend):
    pass


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


@dataclasses.dataclass
class _Rig:
    rt: Runtime
    loop: _WatchedLoop
    gate: _Gate
    fake: FakeVendor | None

    def device(self, layers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors as the paged KV of this device (shared memory on the fakes)."""
        fake = self.fake
        return layers if fake is None else [fake.adopt(t) for t in layers]

    def blocks(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """The bytes of blocks ``IDS`` now (no stream is synchronized)."""
        fake = self.fake
        read = (lambda t: t) if fake is None else fake.peek
        return torch.stack([read(t)[:, list(IDS)] for t in layers])

    def after_held(self, call: Callable[[], object]) -> None:
        """Run ``call`` (a blocking transfer) while the earlier transfer is held in transit;
        open the gate once ``call`` queued its message (rule kept) or returned (broken)."""
        assert self.gate.entered.wait(_WAIT), "the earlier transfer never reached the loop"
        with self.loop.on_submit(self.gate.open):
            call()
        self.gate.open()  # ran inline: nothing was queued, so the hook never fired


def _backend(kind: str) -> _Held:
    if kind == "cpu":
        return _HeldCpu()
    if kind == "mlu":
        return _HeldMlu(layout_source="resolved")  # the engine resolved NHD explicitly
    return _HeldMusa()


@contextlib.contextmanager
def _rig(kind: str) -> Iterator[_Rig]:
    loops: list[_WatchedLoop] = []

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            loop = _WatchedLoop()
            loops.append(loop)
            return loop

    with contextlib.ExitStack() as stack:
        fake = None if kind == "cpu" else stack.enter_context(fake_vendor(kind, seed=7))
        backend = _backend(kind)
        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(Policy())
        try:
            # CPU: the default (inline); the fake accelerators: inline on request.
            rt = Runtime(backend, inline=None if kind == "cpu" else True).start()
        finally:
            asyncio.set_event_loop_policy(previous)
        stack.callback(rt.close)
        stack.callback(backend.gate.open)  # never leave the loop blocked, even on failure
        assert rt.inline
        assert len(loops) == 1
        backend.gate.hold_next()
        yield _Rig(rt, loops[0], backend.gate, fake)


def _chunk(fill: float) -> list[torch.Tensor]:
    return _kv.objects(1, fill)


@pytest.mark.parametrize("kind", KINDS)
async def test_atransfer_then_blocking_transfer_to_the_same_blocks_land_in_program_order(
    kind: str,
) -> None:
    with _rig(kind) as rig:
        rt = rig.rt
        paged = rig.device(_kv.paged(1))
        scatter = _kv.request(Direction.H2D, IDS)
        first = rt.atransfer(scatter, paged, _chunk(1.0))
        rig.after_held(lambda: rt.transfer(scatter, paged, _chunk(2.0)))
        await first
        got = rig.blocks(paged)
        program_order = torch.equal(got, torch.full_like(got, 2.0))
        assert program_order, (
            "the earlier atransfer landed after the later blocking transfer (stale KV): "
            f"blocks hold {got.unique().tolist()}"
        )


@pytest.mark.parametrize("kind", KINDS)
async def test_blocking_gather_reads_what_an_earlier_atransfer_scattered(kind: str) -> None:
    with _rig(kind) as rig:
        rt = rig.rt
        paged = rig.device([torch.zeros_like(t) for t in _kv.paged(1)])
        first = rt.atransfer(_kv.request(Direction.H2D, IDS), paged, _chunk(7.0))
        out = _chunk(-1.0)
        gather = _kv.request(Direction.D2H, IDS)
        rig.after_held(lambda: rt.transfer(gather, paged, out))
        await first
        read_after_write = torch.equal(out[0], torch.full_like(out[0], 7.0))
        assert read_after_write, (
            "the later gather read the blocks before the earlier-issued scatter wrote them: "
            f"chunk holds {out[0].unique().tolist()}"
        )


@pytest.mark.parametrize("kind", KINDS)
async def test_store_fence_then_blocking_reuse_keeps_the_stored_kv(kind: str) -> None:
    # The serving pattern: store blocks (atransfer D2H), fence them, then reuse them for new
    # KV (a blocking scatter). The store must capture the old KV, never the new.
    with _rig(kind) as rig:
        rt = rig.rt
        paged = rig.device(_kv.paged(4))
        stored = _chunk(-1.0)
        store = rt.atransfer(_kv.request(Direction.D2H, IDS), paged, stored)
        fence = rt.afence(IDS)
        reuse = _kv.request(Direction.H2D, IDS)
        rig.after_held(lambda: rt.transfer(reuse, paged, _chunk(9.0)))
        await store
        assert (await fence).block_ids == IDS
        want = _kv.expected_gather(_kv.paged(4), IDS)
        old_kv = _kv.same(stored[0], want[0])
        assert old_kv, "the store captured KV written by a scatter issued after it and its fence"
        new = rig.blocks(paged)
        assert torch.equal(new, torch.full_like(new, 9.0))
