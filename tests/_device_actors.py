"""The actors a Runtime runs, reached through :class:`DeviceActors` rather than the Runtime.

A test that must reach inside (a plan cache, an IPC owner, the directory of stream actors, or
the event loop the actors run on) records each :class:`DeviceActors` group as it starts; the
Runtime's own fields stay private to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors.actors.group import DeviceActors

if TYPE_CHECKING:
    import asyncio

    import pytest

__all__ = ("loop_of", "started_actors")


def started_actors(monkeypatch: pytest.MonkeyPatch) -> list[DeviceActors]:
    """The :class:`DeviceActors` groups started from now on in this test, in start order (a
    Runtime starts one on its loop, before its start returns)."""
    started: list[DeviceActors] = []
    start = DeviceActors.start

    def recording(self: DeviceActors) -> None:
        start(self)
        started.append(self)

    monkeypatch.setattr(DeviceActors, "start", recording)
    return started


def loop_of(actors: DeviceActors) -> asyncio.AbstractEventLoop:
    """The event loop ``actors`` run on."""
    loop = actors.gather.loop
    assert loop is not None, "the actors never started"
    return loop
