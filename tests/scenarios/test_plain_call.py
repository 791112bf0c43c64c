"""The plain-call turn: a blocking transfer that finds its actors idle runs both turns itself,
with no message, envelope or reply slot; anything else takes the mailbox.

* idle actors: a run of transfers leaves the GatherActor's mailbox untouched (its peak stays
  0, which any delivered envelope raises) with the same counters and bytes as the mailbox
  route, on CPU and both fakes (answered at enqueue there);
* observed, the plain call admits itself in its gather turn (admission order is turn order);
* a wait for a device's completion is a plain call too: it gives its turns and routes back
  before it sleeps on the reaper's answer, so a later call on its stream runs meanwhile;
* a queued message is never overtaken: with an ``a*`` store queued behind a held event loop,
  a blocking store of the same block from another thread lands after it;
* contended plain calls sleep on the route of the plain call before them (nothing queues)
  and run their own turns on their own threads; a close fails one still waiting as not
  served;
* an interrupt after a plain call's launch enqueued its copy leaves the copy's lease with the
  reaper and its blocks in the ledger until the device ran it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from typing import TYPE_CHECKING, Any

import pytest

from kvactors.actors import actor as actor_module
from kvactors.actors.reply import Reply
from kvactors.core.layouts import Direction
from kvactors.devices.cpu import CpuBackend
from kvactors.errors import ActorClosedError
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from kvactors.testing.manual import ManualBackend
from tests._device_actors import loop_of, started_actors
from tests.scenarios._kv import expected_gather, objects, paged, request, same

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    import torch

    from kvactors.core.plans import TransferRequest
    from kvactors.devices.base import Marker, StreamLike
    from kvactors.runtime.observer import Call
    from kvactors.testing import FakeVendor

_WAIT = 10.0  # bounds a wait that only a hang would exhaust; never decides a result


@contextlib.contextmanager
def _runtime(kind: str) -> Iterator[tuple[Runtime, list[Any], FakeVendor | None]]:
    with contextlib.ExitStack() as stack:
        fake = None if kind == "cpu" else stack.enter_context(fake_vendor(kind, seed=4))
        host = paged(9)
        layers = host if fake is None else [fake.adopt(t.clone()) for t in host]
        backend: Any = kind
        if kind == "mlu":
            from kvactors.devices.mlu.backend import MluBackend

            backend = MluBackend(layout_source="resolved")
        rt = stack.enter_context(Runtime(backend))
        yield rt, layers, fake


def _gather_stats(rt: Runtime) -> Any:
    (gather,) = [a for a in rt.statistics().actors if a.name.startswith("gather:")]
    return gather


def _run(kind: str, *, via: str, complete: bool) -> tuple[Any, list[torch.Tensor], Any]:
    """Four gathers ``via`` the plain call, the plain call observed, or the mailbox (an
    ``a*`` call); the GatherActor's statistics, the chunks, the transfer counters."""
    with _runtime(kind) as (rt, layers, fake):
        log = _Log()
        if via == "observed":
            rt.add_observer(log)
        host = layers if fake is None else [fake.peek(t) for t in layers]
        outs = []
        for ids in ((0, 1), (2, 3), (4, 5), (6, 7)):
            out = objects(1)
            req = request(Direction.D2H, ids)
            if via == "mailbox":

                async def queued(req: TransferRequest = req, out: Any = out) -> Any:
                    return await rt.atransfer(req, layers, out, complete=complete)

                asyncio.run(queued())
            else:
                rt.transfer(req, layers, out, complete=complete)
            rt.synchronize()
            assert same(out[0], expected_gather(host, ids)[0]), (kind, ids)
            outs.append(out[0])
        if via == "observed":  # each call admitted once, in order, and finished
            assert [e for e, _ in log.seen] == ["started", "finished"] * 4
            seqs = [n for _, n in log.seen]
            assert seqs[0::2] == seqs[1::2] == sorted(set(seqs))
        stats = rt.statistics()
        return _gather_stats(rt), outs, (stats.transfers_ok, stats.transfers_failed)


class _Log:
    """An observer recording (event, admission number) of the transfers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def call_started(self, call: Call) -> None:
        if call.op == "transfer":
            self.seen.append(("started", call.seq))

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        if call.op == "transfer":
            assert error is None
            self.seen.append(("finished", call.seq))


@pytest.mark.parametrize("complete", [True, False], ids=["complete", "enqueued"])
@pytest.mark.parametrize("kind", ["cpu", "mlu", "musa"])
def test_idle_actors_take_the_plain_call_with_the_mailbox_routes_results(
    kind: str, complete: bool
) -> None:
    runs = {via: _run(kind, via=via, complete=complete) for via in ("plain", "observed", "mailbox")}
    assert runs["plain"][0].mailbox_peak == 0  # no envelope was ever delivered
    assert runs["observed"][0].mailbox_peak == 0  # observed too
    assert runs["mailbox"][0].mailbox_peak >= 1
    counters = {via: (run[0].processed, run[0].failed, run[2]) for via, run in runs.items()}
    assert counters["plain"] == counters["observed"] == counters["mailbox"]
    assert counters["plain"][2] == (4, 0)
    for via in ("observed", "mailbox"):
        assert all(same(a, b) for a, b in zip(runs["plain"][1], runs[via][1], strict=True))


def test_a_plain_call_waiting_for_completion_holds_no_turn_and_answers_once_the_copy_ran() -> None:
    backend = ManualBackend()  # nothing runs until released
    with Runtime(backend) as rt:
        layers = paged(5)
        got = objects(1)
        out: dict[str, Any] = {}

        def wait() -> None:
            try:
                out["A"] = rt.transfer(request(Direction.D2H, (2, 3)), layers, got)
            except BaseException as exc:
                out["A"] = exc

        a = threading.Thread(target=wait, name="A")
        a.start()
        assert backend.wait_for(lambda b: b.queued() == 1)
        # A sleeps on the reaper's answer holding no turn: B's plain call runs meanwhile.
        rt.transfer(request(Direction.D2H, (0, 1)), layers, objects(1), complete=False)
        assert backend.queued() == 2
        assert a.is_alive(), "answered before the device ran the copy"
        assert not out
        assert rt.statistics().inflight == 2
        backend.release()
        a.join(_WAIT)
        assert out["A"].nbytes == got[0].numel() * got[0].element_size()
        assert same(got[0], expected_gather(layers, (2, 3))[0])
        assert _gather_stats(rt).mailbox_peak == 0  # no envelope: both were plain calls
        # A's ledger entry ended before its answer: a fence on its blocks waits for nothing.
        assert rt.fence((2, 3), timeout=_WAIT).waited_for == 0
        rt.synchronize()
        assert rt.statistics().inflight == 0
        assert backend.use_after_free == 0


@pytest.mark.parametrize("kind", ["cpu", "mlu", "musa"])
def test_a_queued_message_is_not_overtaken_by_a_plain_call(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = started_actors(monkeypatch)
    with _runtime(kind) as (rt, layers, _fake):
        rt.transfer(request(Direction.D2H, (0, 1)), layers, objects(1))  # warm
        rt.synchronize()
        loop = loop_of(*started)
        held, entered = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            assert held.wait(_WAIT), "the loop was never released"

        loop.call_soon_threadsafe(hold)
        assert entered.wait(_WAIT)
        try:
            # Queued while the loop is held: an a* call never runs a turn itself.
            first = rt.atransfer(request(Direction.H2D, (8, 9)), layers, objects(1, 1.0))
            assert _gather_stats(rt).mailbox_depth == 1
            done: list[BaseException | None] = []

            def store() -> None:
                try:
                    # Answered at enqueue on a vendor: the call shape of the plain call.
                    rt.transfer(
                        request(Direction.H2D, (8, 9)),
                        layers,
                        objects(1, 2.0),
                        complete=kind == "cpu",
                    )
                except BaseException as exc:
                    done.append(exc)
                else:
                    done.append(None)

            t = threading.Thread(target=store)
            t.start()
            # The blocking store queues behind the a* one instead of running now.
            for _ in range(int(_WAIT / 0.001)):
                if _gather_stats(rt).mailbox_depth == 2 or not t.is_alive():
                    break
                t.join(0.001)
            assert t.is_alive(), f"the blocking store ran before the queued one: {done}"
        finally:
            held.set()
        t.join(_WAIT)
        assert done == [None]
        del first
        rt.fence((8, 9), timeout=_WAIT)
        rt.synchronize()
        out = objects(1)
        rt.transfer(request(Direction.D2H, (8, 9)), layers, out)
        assert bool((out[0] == 2.0).all()), "the queued store landed after the later one"


class _MarkerInterrupted(ManualBackend):
    """A device whose next marker, once armed, is interrupted (a signal's exception right
    after the launch enqueued the copy)."""

    armed = False

    def record_marker(self, stream: StreamLike) -> Marker:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().record_marker(stream)


def test_an_interrupt_after_a_plain_launch_keeps_the_lease_and_the_blocks_until_the_copy_ran() -> (
    None
):
    backend = _MarkerInterrupted()  # nothing runs until released
    with Runtime(backend) as rt:
        host = paged(3)
        backend.armed = True
        with pytest.raises(KeyboardInterrupt):
            rt.transfer(request(Direction.D2H, (2, 3)), host, objects(1), complete=False)
        assert backend.queued() == 1  # the copy was enqueued before the interrupt
        # Its ledger entry stays open (a fence on its blocks waits) and its lease is kept
        # until the device ran it.
        assert rt.statistics().inflight == 1
        backend.release()
        assert backend.use_after_free == 0
        rt.fence((2, 3), timeout=_WAIT)
        stats = rt.statistics()
        assert (stats.inflight, stats.transfers_failed) == (0, 1)


class _HeldCpu(CpuBackend):
    """Holds the first armed ``prepare_transfer`` (a GatherActor turn) until ``open``; records
    each one's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self._open = threading.Event()
        self.prepared: list[str] = []

    def open(self) -> None:
        self._open.set()

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        self.prepared.append(threading.current_thread().name)
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self._open.wait(_WAIT), "the held call was never released"
        return super().prepare_transfer(request, paged, objects)


def _waiting_for_a_route(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is actor_module.take_route.__code__:
            return True
        frame = frame.f_back
    return False


def _start(rt: Runtime, layers: Any, name: str, ids: tuple[int, ...], out: dict[str, Any]):
    def run() -> None:
        try:
            got = objects(1)
            rt.transfer(request(Direction.D2H, ids), layers, got)
            out[name] = same(got[0], expected_gather(layers, ids)[0])
        except BaseException as exc:
            out[name] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    return t


def _until(what: Callable[[], bool], thread: threading.Thread) -> None:
    for _ in range(int(_WAIT / 0.001)):
        if what():
            return
        assert thread.is_alive(), f"{thread.name} returned instead of waiting"
        thread.join(0.001)
    raise AssertionError(f"{thread.name} never waited for the route")


def test_contended_plain_calls_wait_for_the_route_and_run_their_own_turns() -> None:
    backend = _HeldCpu()
    with Runtime(backend) as rt:
        layers = paged(5)
        rt.transfer(request(Direction.D2H, (0, 1)), layers, objects(1))  # warm
        backend.prepared.clear()
        backend.armed = True
        out: dict[str, Any] = {}
        a = _start(rt, layers, "A", (2, 3), out)
        assert backend.entered.wait(_WAIT)
        b = _start(rt, layers, "B", (4, 5), out)
        _until(lambda: _waiting_for_a_route(b), b)
        # B sleeps on the route: nothing queued, nothing of it ran.
        assert _gather_stats(rt).mailbox_depth == 0
        assert backend.prepared == ["A"]
        backend.open()
        for t in (a, b):
            t.join(_WAIT)
        assert out == {"A": True, "B": True}
        # B's turns ran on B's thread, after A's gather turn: never on the loop.
        assert backend.prepared == ["A", "B"]
        assert _gather_stats(rt).mailbox_peak == 0


def test_a_close_fails_a_plain_call_waiting_for_its_route_as_not_served() -> None:
    backend = _HeldCpu()
    rt = Runtime(backend, stop_timeout=0.05).start()
    try:
        layers = paged(5)
        rt.transfer(request(Direction.D2H, (0, 1)), layers, objects(1))  # warm
        backend.armed = True
        out: dict[str, Any] = {}
        a = _start(rt, layers, "A", (2, 3), out)
        assert backend.entered.wait(_WAIT)
        b = _start(rt, layers, "B", (4, 5), out)
        _until(lambda: _waiting_for_a_route(b), b)
        closer = threading.Thread(target=rt.close, name="closer")
        closer.start()
        b.join(_WAIT)
        assert not b.is_alive(), "the waiting call outlived the close"
        assert type(out["B"]) is ActorClosedError
    finally:
        backend.open()
        a.join(_WAIT)
        rt.close()
    closer.join(_WAIT)
    assert not closer.is_alive()


class _HeldCopies(CpuBackend):
    """Holds the copy of the transfer of block ids ``hold`` (inside its kernel, before any
    byte moved) until ``open``; records the ids of each copy as it starts."""

    def __init__(self, hold: tuple[int, ...]) -> None:
        super().__init__()
        self.hold = hold
        self.entered = threading.Event()
        self._open = threading.Event()
        self.started: list[tuple[int, ...]] = []

    def open(self) -> None:
        self._open.set()

    def transfer_kernel(
        self, plan: Any, paged: Any, objects: Sequence[torch.Tensor], torch_kernel: Any
    ) -> Any:
        ids = tuple(plan.request.block_ids)

        def kernel() -> None:
            self.started.append(ids)
            if ids == self.hold:
                self.entered.set()
                assert self._open.wait(_WAIT), "the held copy was never released"
            torch_kernel()

        return kernel


def _in(thread: threading.Thread, code: Any) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("second", ["apart", "reading the same"])
def test_cpu_copies_run_beside_each_other_unless_one_writes_what_another_touches(
    second: str,
) -> None:
    backend = _HeldCopies(hold=(2, 3))
    with Runtime(backend) as rt:
        layers = paged(5)
        out: dict[str, Any] = {}
        a = _start(rt, layers, "A", (2, 3), out)
        assert backend.entered.wait(_WAIT)
        # A's copy is under way (held): a gather of other blocks, or of one of A's (both
        # only read the paged blocks), runs to the end beside it.
        b = _start(rt, layers, "B", (4, 5) if second == "apart" else (3, 4), out)
        b.join(_WAIT)
        assert not b.is_alive(), "the second copy waited for the first"
        assert out == {"B": True}
        backend.open()
        a.join(_WAIT)
        assert out == {"A": True, "B": True}
        assert _gather_stats(rt).mailbox_peak == 0


def test_a_cpu_copy_that_writes_blocks_of_a_copy_in_flight_runs_after_it() -> None:
    backend = _HeldCopies(hold=(2, 3))
    with Runtime(backend) as rt:
        layers = paged(5)
        before = expected_gather(layers, (2, 3))[0]
        read = objects(1)
        calls = {
            # A reads blocks 2 and 3 (held in its copy); B then writes blocks 3 and 4.
            "A": lambda: rt.transfer(request(Direction.D2H, (2, 3)), layers, read),
            "B": lambda: rt.transfer(request(Direction.H2D, (3, 4)), layers, objects(1, 7.0)),
        }
        threads = {n: threading.Thread(target=fn, name=n) for n, fn in calls.items()}
        threads["A"].start()
        assert backend.entered.wait(_WAIT)
        b = threads["B"]
        b.start()
        _until(lambda: _in(b, Reply.wait.__code__), b)
        assert backend.started == [(2, 3)]  # B sleeps on A's copy; its own has not started
        backend.open()
        for t in threads.values():
            t.join(_WAIT)
        assert backend.started == [(2, 3), (3, 4)]
        assert same(read[0], before)  # A read the blocks as they were before B's write
        got = objects(1)
        rt.transfer(request(Direction.D2H, (3, 4)), layers, got)
        assert bool((got[0] == 7.0).all())  # and B's write landed
        assert _gather_stats(rt).mailbox_peak == 0
