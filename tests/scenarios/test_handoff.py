"""Contended callers on the mailbox: a busy actor hands its turn to the waiting sender, in
mailbox order. (The held backends replace ``launch``, so they do not complete on launch, and a
call that waits for completion there takes the mailbox: the plain calls of idle actors and
their routes are tests/scenarios/test_plain_call.py's.)

A blocking call whose message had to queue behind a busy actor sleeps until its reply anyway;
when the turn ends, the turn passes to that caller's thread, which runs it there (validation,
planning, the enqueue of its copy) instead of a hop to the event loop and the stream's lane.
The tests hold the first call inside its turn (a backend gate, on the caller's own thread),
queue two more callers behind it (public statistics show the mailbox depth), then open the
gate and read which thread ran each call's host work, in which order. Each wait is a state
wait bounded by ``_WAIT``, which only a hang exhausts; no result depends on time.

* held in the GatherActor's turn (``prepare``): the waiting callers run their own gather turns,
  and their copies, on their own threads, in FIFO order;
* held in the StreamActor's turn (``launch``, the copy): the GatherActor's turn ended before
  the copy ran, so the next callers validate and plan meanwhile and queue at the stream, whose
  turn is then handed to each of them, in FIFO order;
* a caller whose deadline passed while queued does not strand the actor: its message runs on
  the loop, and the callers behind it still get the turn handed over;
* a close fails the queued callers with the "not served" error, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import pytest

from kvactors.core.layouts import Direction
from kvactors.devices.base import Backend
from kvactors.devices.cpu import CpuBackend
from kvactors.devices.mlu.backend import MluBackend
from kvactors.devices.musa.backend import MusaBackend
from kvactors.errors import ActorClosedError, DeadlineExceededError, TransferAbandonedError
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios import _kv

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    import torch

    from kvactors.core.plans import TransferRequest
    from kvactors.devices.base import StreamLike
    from kvactors.testing import FakeVendor

_WAIT = 10.0  # bounds a wait that only a hang would exhaust; never decides a result
KINDS = ["cpu", "mlu", "musa"]
LOOP = "kvactors-loop"


class _Held(Backend):
    """Records the thread of every ``prepare_transfer`` (GatherActor turn) and ``launch``
    (StreamActor turn); holds the first one of the armed kind until :meth:`open`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held_at = ""
        self.entered = threading.Event()
        self._open = threading.Event()
        self.prepared: list[str] = []
        self.launched: list[str] = []

    def open(self) -> None:
        self._open.set()

    def _pass(self, where: str) -> None:
        if self.held_at == where:
            self.held_at = ""
            self.entered.set()
            assert self._open.wait(_WAIT), "the held call was never released"

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        self.prepared.append(threading.current_thread().name)
        self._pass("prepare")
        return super().prepare_transfer(request, paged, objects)

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        self.launched.append(threading.current_thread().name)
        self._pass("launch")
        super().launch(stream, fn)  # type: ignore[safe-super]  # the device's backend, next in the MRO


class _HeldCpu(_Held, CpuBackend):
    pass


class _HeldMlu(_Held, MluBackend):
    pass


class _HeldMusa(_Held, MusaBackend):
    pass


def _backend(kind: str) -> _Held:
    if kind == "cpu":
        return _HeldCpu()
    if kind == "mlu":
        return _HeldMlu(layout_source="resolved")  # the engine resolved NHD explicitly
    return _HeldMusa()


@dataclasses.dataclass
class _Rig:
    rt: Runtime
    backend: _Held
    fake: FakeVendor | None
    layers: list[Any]
    outcomes: dict[str, BaseException | None] = dataclasses.field(default_factory=dict)
    threads: dict[str, threading.Thread] = dataclasses.field(default_factory=dict)

    def call(self, name: str, ids: tuple[int, ...], timeout: float | None = None) -> None:
        """Start a blocking gather of ``ids`` on a thread of its own called ``name``."""

        def run() -> None:
            try:
                out = _kv.objects(1)
                self.rt.transfer(_kv.request(Direction.D2H, ids), self.layers, out, timeout=timeout)
                expected = _kv.expected_gather(self.host, ids)[0]
                assert _kv.same(out[0], expected), f"{name} gathered wrong bytes"
            except BaseException as exc:
                self.outcomes[name] = exc
            else:
                self.outcomes[name] = None

        t = threading.Thread(target=run, name=name)
        self.threads[name] = t
        t.start()

    @property
    def host(self) -> list[torch.Tensor]:
        fake = self.fake
        return self.layers if fake is None else [fake.peek(t) for t in self.layers]

    def depth(self, actor: str) -> int:
        """Envelopes queued at the device's actor whose name starts with ``actor``."""
        stats = self.rt.statistics()
        return sum(a.mailbox_depth for a in stats.actors if a.name.startswith(actor))

    def until(self, what: Callable[[], bool], watch: str) -> None:
        """Wait (a state wait) until ``what()`` holds; fail if ``watch`` ended first."""
        t = self.threads[watch]
        for _ in range(int(_WAIT / 0.001)):
            if what():
                return
            assert t.is_alive(), f"{watch} returned instead of queueing: {self.outcomes}"
            t.join(0.001)
        raise AssertionError(f"{watch} never queued where expected: {self.rt.statistics()}")

    def join(self, name: str) -> BaseException | None:
        t = self.threads[name]
        t.join(_WAIT)
        assert not t.is_alive(), f"{name} never returned (a stranded turn?)"
        return self.outcomes[name]


@contextlib.contextmanager
def _rig(kind: str, held_at: str, **runtime: Any) -> Iterator[_Rig]:
    with contextlib.ExitStack() as stack:
        fake = None if kind == "cpu" else stack.enter_context(fake_vendor(kind, seed=11))
        backend = _backend(kind)
        host = _kv.paged(5)
        layers = host if fake is None else [fake.adopt(t.clone()) for t in host]
        rt = Runtime(backend, **runtime).start()
        stack.callback(rt.close)
        stack.callback(backend.open)  # never leave a caller held, even on failure
        rig = _Rig(rt, backend, fake, layers)
        rig.call("warm", (0, 1))  # the stream actor and its lane exist: no first-use work
        assert rig.join("warm") is None
        backend.prepared.clear()
        backend.launched.clear()
        backend.held_at = held_at
        yield rig


def _queue_behind_a(rig: _Rig, at: str) -> None:
    # A holds the turn; B, then C, queue at actor ``at`` (FIFO: B first).
    rig.call("A", (3, 5))
    assert rig.backend.entered.wait(_WAIT), "A never reached its turn"
    for n, name in enumerate(("B", "C"), 1):
        rig.call(name, (6 + 2 * n, 7 + 2 * n))

        def queued(n: int = n) -> bool:
            return rig.depth(at) == n

        rig.until(queued, name)


@pytest.mark.parametrize("kind", KINDS)
def test_callers_queued_at_a_busy_gather_actor_run_their_own_turns_in_fifo_order(
    kind: str,
) -> None:
    with _rig(kind, "prepare") as rig:
        _queue_behind_a(rig, "gather:")
        rig.backend.open()
        assert [rig.join(n) for n in "ABC"] == [None, None, None]
        # Each caller validated, planned and enqueued its own copy, on its own thread, in
        # the order the messages arrived; none of it went through the loop.
        assert rig.backend.prepared == ["A", "B", "C"]
        assert rig.backend.launched == ["A", "B", "C"]


@pytest.mark.parametrize("kind", KINDS)
def test_callers_plan_while_a_copy_runs_and_run_their_own_copies_in_fifo_order(
    kind: str,
) -> None:
    with _rig(kind, "launch") as rig:
        # A's copy is held in the StreamActor's turn: the GatherActor is free, so B and C
        # validate and plan on their threads now and queue their Launch at the stream.
        _queue_behind_a(rig, "stream:")
        assert rig.backend.prepared == ["A", "B", "C"]
        assert rig.depth("gather:") == 0
        rig.backend.open()
        assert [rig.join(n) for n in "ABC"] == [None, None, None]
        assert rig.backend.launched == ["A", "B", "C"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_caller_whose_deadline_passed_while_queued_does_not_strand_the_actor(
    kind: str,
) -> None:
    with _rig(kind, "prepare") as rig:
        rig.call("A", (3, 5))
        assert rig.backend.entered.wait(_WAIT), "A never reached its turn"
        # B gives up while A holds the turn (A is held until B returned: only B's own
        # deadline can end its wait), then C queues behind B's message.
        rig.call("B", (8, 9), timeout=0.01)
        assert isinstance(rig.join("B"), DeadlineExceededError)
        rig.call("C", (10, 11))
        rig.until(lambda: rig.depth("gather:") == 2, "C")
        rig.backend.open()
        assert rig.join("A") is None
        assert rig.join("C") is None
        # B's message still ran, in its place: on the loop, since B was gone; C, behind it,
        # still had the turn handed over.
        assert rig.backend.prepared == ["A", LOOP, "C"]
        rig.rt.synchronize()
        stats = rig.rt.statistics()
        assert (stats.transfers_ok, stats.transfers_failed, stats.inflight) == (4, 0, 0)


@pytest.mark.parametrize(
    ("at", "error"),
    [("prepare", ActorClosedError), ("launch", TransferAbandonedError)],
    ids=["queued-at-gather", "queued-at-stream"],
)
def test_close_fails_the_queued_callers(at: str, error: type[BaseException]) -> None:
    """Queued at the GatherActor, nothing of B and C ran: "not served". Queued at the
    stream, their Launch was delivered: the close gives up on them and says that they may
    still land (the stream's own graceful stop may still run them), as before the hand-off."""
    with _rig("cpu", at, stop_timeout=0.05) as rig:
        _queue_behind_a(rig, "gather:" if at == "prepare" else "stream:")
        closer = threading.Thread(target=rig.rt.close, name="closer")
        closer.start()
        # The close gives up on draining A's held turn and fails what queued behind it.
        for name in "BC":
            err = rig.join(name)
            assert type(err) is error, (name, err)
        rig.backend.open()
        rig.join("A")
        closer.join(_WAIT)
        assert not closer.is_alive()
        # A caller that got its answer is gone: no turn was handed to it afterwards.
        assert not {"B", "C"} & set(rig.backend.launched)
        assert rig.backend.prepared == (["A"] if at == "prepare" else ["A", "B", "C"])
