"""Every exit keeps the rules: an interrupt at any line of a turn.

A signal's exception (``KeyboardInterrupt`` from Ctrl-C, ``SystemExit`` from a SIGTERM
handler) lands on the thread that runs a turn, which is the caller's own thread when the
actors are idle. The test delivers one at the N-th line the caller's thread executes in the
GatherActor's and the StreamActor's turn functions (``sys.settrace`` on their code objects),
for N = 1, 2, ... until a transfer runs without reaching line N, on CPU, ManualBackend and
both fakes, for transfers answered at completion and at enqueue (and the same for a record's
and a synchronize's stream turn on CPU and ManualBackend). After each interrupt:

- the caller saw that exception, as itself (never a ``TransferFailedError``);
- a fence on the transfer's blocks returns, nothing is in flight, no reply is held;
- a later transfer on the same runtime moves the right bytes;
- ``close()`` returns without waiting out its stop timeout;
- on ManualBackend, no lease was dropped before its copy ran (``use_after_free == 0``).
"""

from __future__ import annotations

import contextlib
import dis
import sys
import time
import types
from typing import TYPE_CHECKING, Any

import pytest

from kvactors.actors import stream as stream_module
from kvactors.actors.gather import GatherActor
from kvactors.actors.stream import StreamActor
from kvactors.core.layouts import Direction
from kvactors.kernels import transfer as transfer_kernels
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from kvactors.testing.manual import ManualBackend
from tests.scenarios._kv import expected_gather, objects, paged, request, same

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.devices.base import Backend
    from kvactors.testing import FakeVendor

_STOP = 5.0  # the runtime's stop timeout: close() must not wait it out
# Completion callbacks, not turn lines (they run on reapers).
_COMPLETION = {"on_done", "done"}


def _codes(*, kernel: bool) -> frozenset[types.CodeType]:
    found: set[types.CodeType] = set()

    def walk(code: types.CodeType) -> None:
        if code.co_name in _COMPLETION:
            return
        found.add(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    for fn in (
        GatherActor.receive,
        GatherActor._transfer,
        GatherActor.transfer_now,  # the plain-call turn of idle actors
        GatherActor._plan,  # both drivers' gather turn
        StreamActor.receive,
        StreamActor.launch_now,  # the plain call's stream turn
    ):
        walk(fn.__code__)
    walk(StreamActor._launch.__code__)
    walk(stream_module._LaunchJob.run.__code__)  # the mailbox launch, on a sender's thread
    walk(StreamActor._put.__code__)  # the one launch body
    if kernel:  # the torch kernel the transfer's launch runs
        walk(transfer_kernels.torch_kernel.__code__)
    return frozenset(found)


def _nop_lines(code: types.CodeType) -> frozenset[int]:
    # Lines that start with a NOP (``try:``): CPython never checks for a pending signal there
    # (nor does the enclosing handler cover an exception a tracer raises there), so no
    # interrupt lands on them.
    first: dict[int, str] = {}
    for ins in dis.get_instructions(code):
        pos = ins.positions  # type: ignore[attr-defined]  # 3.11+; the tests run on 3.11
        line = pos.lineno if pos is not None else None
        if line is not None and line not in first:
            first[line] = ins.opname
    return frozenset(line for line, op in first.items() if op == "NOP")


class _Interrupt:
    """A trace function raising ``exc`` at the ``at``-th line run in ``codes``."""

    def __init__(self, codes: frozenset[types.CodeType], at: int, exc: type[BaseException]):
        self.codes, self.at, self.exc = codes, at, exc
        self.skip = {code: _nop_lines(code) for code in codes}
        self.lines = 0
        self.fired: tuple[str, int] | None = None

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        return self._line if frame.f_code in self.codes else None

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if (
            event == "line"
            and self.fired is None
            and frame.f_lineno not in self.skip.get(frame.f_code, ())
        ):
            self.lines += 1
            if self.lines == self.at:
                self.fired = (frame.f_code.co_name, frame.f_lineno)
                raise self.exc
        return self._line


@contextlib.contextmanager
def _device(kind: str) -> Iterator[FakeVendor | None]:
    if kind in ("cpu", "manual"):
        yield None
    else:
        with fake_vendor(kind, seed=3) as fake:
            yield fake


def _backend(kind: str) -> Backend | str:
    if kind == "manual":
        return ManualBackend(auto=True)
    if kind == "mlu":
        from kvactors.devices.mlu.backend import MluBackend

        return MluBackend(layout_source="resolved")
    return kind


def _one(kind: str, fake: FakeVendor | None, at: int, complete: bool) -> bool:
    """Interrupt line ``at`` of one transfer; False once the transfer has fewer lines."""
    exc = KeyboardInterrupt if at % 2 else SystemExit
    host = paged(7)
    layers = host if fake is None else [fake.adopt(t.clone()) for t in host]
    backend = _backend(kind)
    rt = Runtime(backend, stop_timeout=_STOP).start()
    where = f"{kind} complete={complete} line {at}"
    try:
        rt.transfer(request(Direction.D2H, (0, 1)), layers, objects(1))  # warm: actors, plan
        ids = (4, 5)
        trace = _Interrupt(_codes(kernel=kind != "manual"), at, exc)
        raised = False
        sys.settrace(trace)
        try:
            rt.transfer(request(Direction.D2H, ids), layers, objects(1), complete=complete)
        except exc:
            raised = True
        finally:
            sys.settrace(None)
        where = f"{kind} complete={complete} line {at} {trace.fired}"
        if trace.fired is None:
            assert not raised, f"{where}: raised without the interrupt"
            return False
        assert raised, f"{where}: the interrupt did not reach the caller"  # as itself
        try:
            rt.fence(ids, timeout=_STOP)
        except Exception as e:
            raise AssertionError(where) from e
        stats = rt.statistics()
        assert stats.inflight == 0, where
        for actor in stats.actors:
            assert actor.deferred_pending == 0, (where, actor)
            assert actor.mailbox_depth == 0, (where, actor)
        out = objects(1)
        rt.transfer(request(Direction.D2H, (6, 7)), layers, out)
        assert same(out[0], expected_gather(host, (6, 7))[0]), where
        if isinstance(backend, ManualBackend):
            assert backend.use_after_free == 0, where
    finally:
        t0 = time.monotonic()
        rt.close()
        waited = time.monotonic() - t0
    assert waited < _STOP, f"{where}: close() waited out its stop timeout"
    return True


@pytest.mark.parametrize("complete", [True, False])
@pytest.mark.parametrize("kind", ["cpu", "manual", "mlu", "musa"])
def test_an_interrupt_at_any_line_of_a_turn_reaches_the_caller_and_leaves_nothing_held(
    kind: str, complete: bool
) -> None:
    with _device(kind) as fake:
        at = 1
        while _one(kind, fake, at, complete):
            at += 1
        assert at > 10, f"only {at - 1} lines traced: the turn functions were not reached"


def _record_once(kind: str, at: int, call: str) -> bool:
    """Interrupt line ``at`` of a record's or a synchronize's stream turn."""
    exc = KeyboardInterrupt if at % 2 else SystemExit
    rt = Runtime(_backend(kind), stop_timeout=_STOP).start()
    where = f"{kind} {call} line {at}"
    try:
        rt.record_completion(0, "warm", b"0")
        rt.synchronize(0)
        assert rt.drain_completions() == [("warm", b"0")]
        trace = _Interrupt(_record_codes(), at, exc)
        raised = False
        sys.settrace(trace)
        try:
            if call == "record":
                rt.record_completion(0, "cut", b"1")
            else:
                rt.synchronize(0)
        except exc:
            raised = True
        finally:
            sys.settrace(None)
        if trace.fired is None:
            assert not raised, f"{where}: raised without the interrupt"
            return False
        assert raised, f"{where} {trace.fired}: the interrupt did not reach the caller"
        rt.record_completion(0, "after", b"2")
        rt.synchronize(0)
        drained = rt.drain_completions()
        assert drained, f"{where}: a later record is held back"
        assert drained[-1] == ("after", b"2"), (where, drained)
        # The interrupted record was published, withdrawn (counted), or never reserved.
        cut = 1 if call == "record" else 0
        assert len(drained) - 1 + rt.records_withdrawn <= cut, (where, drained)
        stats = rt.statistics()
        assert stats.completions_pending == 0, (where, stats)
        for actor in stats.actors:
            assert actor.deferred_pending == 0, (where, actor)
            assert actor.mailbox_depth == 0, (where, actor)
    finally:
        t0 = time.monotonic()
        rt.close()
        waited = time.monotonic() - t0
    assert waited < _STOP, f"{where}: close() waited out its stop timeout"
    return True


def _record_codes() -> frozenset[types.CodeType]:
    return frozenset(
        fn.__code__ for fn in (StreamActor.receive, StreamActor._record, StreamActor._sync)
    )


@pytest.mark.parametrize("call", ["record", "synchronize"])
@pytest.mark.parametrize("kind", ["cpu", "manual"])
def test_an_interrupt_at_any_line_of_a_record_or_sync_turn_loses_and_holds_nothing(
    kind: str, call: str
) -> None:
    at = 1
    while _record_once(kind, at, call):
        at += 1
    assert at > 3, f"only {at - 1} lines traced: the turn functions were not reached"
