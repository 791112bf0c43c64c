"""The pure ordering core: fences and publication order, through random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvactors.core.ordering import BlockLedger, PublishOrder
from kvactors.errors import ProtocolError


def test_fence_waits_only_for_earlier_transfers_on_its_blocks() -> None:
    led = BlockLedger()
    led.begin(1, [3, 4])
    led.begin(2, [9])
    assert led.fence(100, [4, 5]) == 1
    led.begin(3, [4])  # later transfer on the same block must not delay the fence
    assert led.finish(2) == []
    assert led.finish(1) == [100]
    assert led.fences == 0
    assert led.finish(3) == []
    assert led.inflight == 0


def test_fence_on_idle_blocks_is_ready() -> None:
    led = BlockLedger()
    assert led.fence(1, [1, 2, 3]) == 0
    assert led.fences == 0


def test_begin_apart_refuses_a_transfer_sharing_a_block_unless_both_only_read() -> None:
    ledger = BlockLedger()
    assert ledger.begin_apart(1, frozenset({1, 2}), reads=True)
    assert ledger.begin_apart(2, frozenset({2, 3}), reads=True)  # both read block 2
    assert not ledger.begin_apart(3, frozenset({3}), reads=False)  # writes what 2 reads
    assert 3 not in ledger  # refused: nothing recorded
    assert ledger.begin_apart(3, frozenset({4}), reads=False)  # apart
    assert not ledger.begin_apart(4, frozenset({4}), reads=True)  # reads what 3 writes
    ledger.begin(5, {7})  # begun without begin_apart: counts as a writer
    assert not ledger.begin_apart(6, frozenset({7}), reads=True)
    ledger.finish(2)
    assert ledger.begin_apart(7, frozenset({3}), reads=False)  # 2 finished: 3 is free
    ledger.finish(1)
    ledger.begin(1, {9})  # an id used again is no reader any more
    assert not ledger.begin_apart(8, frozenset({9}), reads=True)
    with pytest.raises(ProtocolError, match="begun twice"):
        ledger.begin_apart(7, frozenset({11}), reads=True)


def test_ledger_rejects_protocol_misuse() -> None:
    led = BlockLedger()
    led.begin(1, [1])
    with pytest.raises(ProtocolError):
        led.begin(1, [2])
    with pytest.raises(ProtocolError):
        led.finish(2)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.frozensets(st.integers(0, 7), min_size=1, max_size=4)),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("fence"), st.frozensets(st.integers(0, 7), min_size=1, max_size=4)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_ledger_model(seq: list[tuple[str, object]]) -> None:
    """A fence is released exactly when every transfer in flight on its blocks at fence time
    has finished, and never earlier."""
    led = BlockLedger()
    inflight: dict[int, frozenset[int]] = {}
    waiting: dict[int, set[int]] = {}
    next_t = next_f = 0
    for op, arg in seq:
        if op == "begin":
            assert isinstance(arg, frozenset)
            led.begin(next_t, arg)
            inflight[next_t] = arg
            next_t += 1
        elif op == "finish":
            assert isinstance(arg, int)
            if not inflight:
                continue
            t = sorted(inflight)[arg % len(inflight)]
            released = led.finish(t)
            del inflight[t]
            expect = []
            for f, waits in list(waiting.items()):
                waits.discard(t)
                if not waits:
                    expect.append(f)
                    del waiting[f]
            assert sorted(released) == sorted(expect)
        else:
            assert isinstance(arg, frozenset)
            waits = {t for t, bs in inflight.items() if bs & arg}
            assert led.fence(next_f, arg) == len(waits)
            if waits:
                waiting[next_f] = waits
            next_f += 1
    assert led.inflight == len(inflight)
    assert led.fences == len(waiting)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_publish_order_drains_submission_order_prefix(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 25))
    order: PublishOrder[int] = PublishOrder()
    seqs = [order.submit() for _ in range(n)]
    withdrawn = set(data.draw(st.lists(st.sampled_from(seqs), max_size=n // 2, unique=True)))
    rest = [s for s in seqs if s not in withdrawn]
    events = data.draw(st.permutations([("w", s) for s in withdrawn] + [("p", s) for s in rest]))
    drained: list[int] = []
    done: set[int] = set()
    for kind, s in events:
        if kind == "w":
            order.withdraw(s)
        else:
            order.publish(s, s)
        done.add(s)
        if data.draw(st.booleans()):
            got = order.drain()
            drained += got
            # A drain never returns a record while an earlier one is still unpublished.
            for r in got:
                assert all(e in done for e in seqs if e < r)
    drained += order.drain()
    assert drained == rest
    assert order.pending == 0


def test_publish_twice_is_a_protocol_error() -> None:
    order: PublishOrder[str] = PublishOrder()
    s = order.submit()
    order.publish(s, "a")
    with pytest.raises(ProtocolError):
        order.publish(s, "b")
