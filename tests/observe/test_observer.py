"""The runtime's observer hook: admission order, the runtime's own ids, settled outcomes."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.core.protocols.gather import Transfer, TransferDone
from kvactors.errors import TransferValidationError
from kvactors.runtime import Runtime
from kvactors.testing.manual import ManualBackend

if TYPE_CHECKING:
    from kvactors.observe import Call

NL, NB, BS, NH, HS = 2, 8, 4, 2, 8


def _request(ids: tuple[int, ...]) -> TransferRequest:
    shape = ShapeDesc(kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=4, dtype="float32")
    return TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(Direction.D2H),
        block_ids=ids,
        chunk_size=len(ids) * BS,
        shape=shape,
    )


def _operands(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(torch.ones(NL, 2, NB, BS, NH, HS).unbind(0)), [torch.zeros(2, NL, n * BS, NH * HS)]


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.events: list[tuple[str, int, str, Any]] = []
        self.admitting_threads: set[str] = set()

    def call_started(self, call: Call) -> None:
        with self.lock:
            self.admitting_threads.add(threading.current_thread().name)
            self.events.append(("started", call.seq, call.op, call.message))
            self.lock.notify_all()

    def wait_started(self, n: int) -> bool:
        """Block until ``n`` calls were admitted (bounded; a hang fails, time never decides)."""
        with self.lock:
            return self.lock.wait_for(
                lambda: sum(e[0] == "started" for e in self.events) >= n, 10.0
            )

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        assert seconds >= 0.0
        with self.lock:
            self.events.append(("finished", call.seq, call.op, error or result))


async def test_admission_order_own_ids_and_settled_outcomes() -> None:
    backend = ManualBackend()  # the store stays in flight until released
    log = _Log()
    rt = Runtime(backend, observer=log).start()
    try:
        paged, objs = _operands(2)
        store = rt.atransfer(_request((1, 2)), paged, objs)
        fence = rt.afence([2])
        assert backend.wait_for(lambda b: b.queued() == 1)
        assert log.wait_started(2)  # the lane may launch the store before the loop admits the fence
        started = [e for e in log.events if e[0] == "started"]
        assert [(e[1], e[2]) for e in started] == [(1, "transfer"), (2, "fence")]
        assert not [e for e in log.events if e[0] == "finished"]  # both still in flight
        backend.release()
        done = await store
        await fence
        message = started[0][3]
        assert isinstance(message, Transfer)
        assert message.transfer_id == done.transfer_id  # the id the actors saw
        finished = [e for e in log.events if e[0] == "finished"]
        assert [(e[1], e[2]) for e in finished] == [(1, "transfer"), (2, "fence")]
        assert isinstance(finished[0][3], TransferDone)
        # Admission happens on the sending thread (a* calls: the caller's), never the loop's.
        assert log.admitting_threads == {threading.current_thread().name}
    finally:
        backend.release()  # anything the lane queued after the first release
        rt.close()


def test_blocking_calls_report_refusals_and_detach() -> None:
    log = _Log()
    with Runtime("cpu") as rt:
        detach = rt.add_observer(log)
        paged, objs = _operands(1)
        with pytest.raises(TransferValidationError):
            rt.transfer(_request((NB,)), paged, objs)  # block id out of range
        rt.synchronize()
        detach()
        rt.ping()
    assert [(e[0], e[2]) for e in log.events] == [
        ("started", "transfer"),
        ("finished", "transfer"),
        ("started", "synchronize"),
        ("finished", "synchronize"),
    ]
    assert isinstance(log.events[1][3], TransferValidationError)


def test_a_failing_observer_never_fails_the_call(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def call_started(self, call: Call) -> None:
            raise RuntimeError("observer bug")

        def call_finished(
            self, call: Call, seconds: float, result: Any, error: BaseException | None
        ) -> None:
            raise RuntimeError("observer bug")

    with Runtime("cpu", observer=Broken()) as rt:
        assert rt.ping(7).seq == 7
    assert (
        sum(
            "observer bug" in (r.exc_text or "") or "failed in call" in r.getMessage()
            for r in caplog.records
        )
        == 2
    )
