"""Shared helpers for the backend tests: fake installation per kind and a lane runner."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.devices.base import Backend, StreamLike

FAKE_KINDS = ("mlu", "musa")


def on_lane(backend: Backend, stream: StreamLike, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a fresh lane thread bound to ``stream`` (as StreamActor does)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            backend.bind_thread(0, stream)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, name="test-lane")
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box.get("value")
