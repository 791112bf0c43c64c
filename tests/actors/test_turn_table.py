"""The turn table is data the code reads: every (turn, event) pair, listed or not, driven on a
real actor, ends where ``TURNS`` says (an unlisted pair changes nothing: a claim is refused, a
send queues, the loop's task leaves the FIFO alone)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from kvactors.actors.actor import TURNS, Actor, Turn, TurnEvent

if TYPE_CHECKING:
    from kvactors.actors.envelope import Envelope


class Probe(msgspec.Struct, frozen=True, tag=True):
    pass


class Seer(Actor[Any]):
    """Records the turn its handler ran in, and on which thread."""

    accepts = (Probe,)
    turns_anywhere = True

    def __init__(self) -> None:
        super().__init__("seer", capacity=8)
        self.seen: list[tuple[Turn, str]] = []

    def receive(self, env: Envelope[Any]) -> Any:
        self.seen.append((self.turn, threading.current_thread().name))
        return None


def _into(actor: Seer, turn: Turn) -> None:
    if turn is Turn.TURN:
        assert actor.claim()
    elif turn is Turn.SHARED:
        assert actor.claim(shared=True)
    assert actor.turn is turn


async def _settle_loop() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(("turn", "event"), list(itertools.product(Turn, TurnEvent)))
async def test_every_pair_of_the_turn_table(turn: Turn, event: TurnEvent) -> None:
    actor = Seer()
    actor.start()
    _into(actor, turn)
    nxt = TURNS.get((turn, event))
    if event in (TurnEvent.CLAIM, TurnEvent.CLAIM_SHARED):
        took = actor.claim(shared=event is TurnEvent.CLAIM_SHARED)
        assert took is (nxt is not None)
        assert actor.turn is (turn if nxt is None else nxt)
    elif event is TurnEvent.SEND:
        # A send from a thread that may run turns: run there, in the table's turn, or queued.
        sender = threading.Thread(target=actor.ask_nowait, args=(Probe(),), name="sender")
        sender.start()
        sender.join()
        if nxt is None:
            assert actor.seen == []
            assert actor.statistics().mailbox_depth == 1
            assert actor.turn is turn
        else:
            assert actor.seen == [(nxt, "sender")]
            assert actor.turn is Turn.IDLE  # the turn ended with the handler
    elif event is TurnEvent.RUN:
        # Queued for the loop's task: it runs the head in the table's turn, or leaves it.
        actor.ask_nowait(Probe(), here=False)
        await _settle_loop()
        if nxt is None:
            assert actor.seen == []
            assert actor.turn is turn
        else:
            assert [t for t, _ in actor.seen] == [nxt]
    elif event is TurnEvent.END:
        if turn is Turn.SHARED:
            assert actor.claim(shared=True)  # a second hold: this end is not the last
        actor.end_turn()
        assert actor.turn is (turn if nxt is None else nxt)
    else:  # END_LAST: only shared holds are counted, so only a shared turn has a last one
        if turn is Turn.SHARED:
            actor.end_turn()
            assert actor.turn is nxt
        else:
            assert nxt is None
    # Whatever was refused or queued runs once the turn is given back.
    while actor.turn is not Turn.IDLE:
        actor.end_turn()
    await _settle_loop()
    assert actor.statistics().mailbox_depth == 0
    await actor.stop()


async def test_a_shared_turn_ends_with_its_last_hold() -> None:
    actor = Seer()
    actor.start()
    assert actor.claim(shared=True)
    assert actor.claim(shared=True)
    turns = []
    for _ in range(2):
        actor.end_turn()
        turns.append(actor.turn)
    assert turns == [Turn.SHARED, Turn.IDLE]
    await actor.stop()


def test_the_table_lists_only_known_turns_and_events() -> None:
    assert all(isinstance(t, Turn) and isinstance(e, TurnEvent) for t, e in TURNS)
    assert all(isinstance(n, Turn) for n in TURNS.values())
    # Every event leads somewhere from some turn (no dead row), and IDLE takes every claim.
    assert {e for _, e in TURNS} == set(TurnEvent)
