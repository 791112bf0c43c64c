"""Program order across entry points: an ``a*`` call admitted before a blocking ``transfer``
is ordered before it, on every device.

The earlier message is held inside its turn (``prepare_transfer`` blocks on a gate), and the
gate opens once the later call either returned (it overtook: broken) or queued behind it
(public statistics show the mailbox depth). No sleeps; each case fails on the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import Direction
from kvactors.devices.base import Backend
from kvactors.devices.cpu import CpuBackend
from kvactors.devices.mlu.backend import MluBackend
from kvactors.devices.musa.backend import MusaBackend
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios import _kv

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from kvactors.core.plans import TransferRequest
    from kvactors.testing import FakeVendor

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
    """Work complete when launched (CPU)."""


class _HeldMlu(_Held, MluBackend):
    pass


class _HeldMusa(_Held, MusaBackend):
    pass


@dataclasses.dataclass
class _Rig:
    rt: Runtime
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
        """Run ``call`` (a blocking transfer) while the earlier transfer is held in its turn;
        open the gate once ``call`` queued its message (rule kept) or returned (broken)."""
        assert self.gate.entered.wait(_WAIT), "the earlier transfer never reached its turn"
        failure: list[BaseException] = []

        def run() -> None:
            try:
                call()
            except BaseException as exc:
                failure.append(exc)

        caller = threading.Thread(target=run)
        caller.start()
        while caller.is_alive() and not self._queued():
            caller.join(0.001)  # a state wait: whichever comes first decides nothing by time
        self.gate.open()
        caller.join(_WAIT)
        assert not caller.is_alive()
        if failure:
            raise failure[0]

    def _queued(self) -> bool:
        stats = self.rt.statistics()
        return any(a.name.startswith("gather:") and a.mailbox_depth for a in stats.actors)


def _backend(kind: str) -> _Held:
    if kind == "cpu":
        return _HeldCpu()
    if kind == "mlu":
        return _HeldMlu(layout_source="resolved")  # the engine resolved NHD explicitly
    return _HeldMusa()


@contextlib.contextmanager
def _rig(kind: str) -> Iterator[_Rig]:
    with contextlib.ExitStack() as stack:
        fake = None if kind == "cpu" else stack.enter_context(fake_vendor(kind, seed=7))
        backend = _backend(kind)
        rt = Runtime(backend).start()
        stack.callback(rt.close)
        stack.callback(backend.gate.open)  # never leave the loop blocked, even on failure
        backend.gate.hold_next()
        yield _Rig(rt, backend.gate, fake)


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
        fence = rt.afence(IDS, timeout=_WAIT)
        reuse = _kv.request(Direction.H2D, IDS)
        rig.after_held(lambda: rt.transfer(reuse, paged, _chunk(9.0)))
        await store
        assert (await fence).block_ids == IDS
        want = _kv.expected_gather(_kv.paged(4), IDS)
        old_kv = _kv.same(stored[0], want[0])
        assert old_kv, "the store captured KV written by a scatter issued after it and its fence"
        new = rig.blocks(paged)
        assert torch.equal(new, torch.full_like(new, 9.0))
