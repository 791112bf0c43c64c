"""The runtime floor: :class:`Runtime` (the loop thread, one device's actors, a blocking facade
for foreign threads and ``a*`` twins for asyncio), its reply bridges and its observer hook."""

from __future__ import annotations

from kvactors.runtime._latency import LATENCY_BOUNDS
from kvactors.runtime._runtime import Runtime, get_runtime, resolve_backend

__all__ = ("LATENCY_BOUNDS", "Runtime", "get_runtime", "resolve_backend")
