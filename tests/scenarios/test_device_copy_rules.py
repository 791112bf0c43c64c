"""A transfer launched on the caller's thread on an accelerator keeps the device's copy rules.

A caller that finds the actors idle launches its copies on its own thread, else the stream's
lane does (one route, see ``docs/architecture.md``). Either way the transfer copies alike:
rule 6 (blocking strided D2H) comes from the backend's copy policy (``Backend.copy_``), and
the fake vendors' ``strided_d2h_bug`` knob reproduces torch_mlu's bug deterministically (an
asynchronous device-to-host copy into a non-contiguous host slice leaves zeros there, even
after a synchronize). A gather whose last chunk is partial copies into such a slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvactors.core.layouts import Direction
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios._kv import expected_gather, objects, paged, request, same

if TYPE_CHECKING:
    from kvactors.devices.base import Backend

IDS = (2, 7, 9)  # three blocks, two per chunk: the second chunk is partial


def _backend(kind: str) -> Backend:
    if kind == "mlu":
        from kvactors.devices.mlu.backend import MluBackend

        return MluBackend(layout_source="resolved")  # the engine resolved NHD explicitly
    from kvactors.devices.musa.backend import MusaBackend

    return MusaBackend()


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_rule6_partial_chunk_gather_is_exact(kind: str) -> None:
    with fake_vendor(kind, strided_d2h_bug=True, seed=1) as fake:
        host = paged(3)
        src = [fake.adopt(t) for t in host]
        with Runtime(_backend(kind)) as rt:
            out = [o.pin_memory() for o in objects(2)]
            rt.transfer(request(Direction.D2H, IDS), src, out)
            stats = rt.statistics()
        launches = sum(a.processed for a in stats.actors if a.name.startswith("stream:"))
        assert launches == 1  # one route: the transfer was a Launch on the stream actor
        want = expected_gather(host, IDS)
        exact = all(same(a, b) for a, b in zip(out, want, strict=True))
        assert exact, "a strided device-to-host copy was not blocking: the chunk holds zeros"


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_staging_buffers_belong_to_the_runtime_and_go_when_it_closes(kind: str) -> None:
    """Device calls (launched on the caller's thread or the lane) stage through device
    buffers. They are the runtime's (counted in
    ``scratch_allocations``) and released when it closes, not kept by the calling thread
    until it ends (a long-lived engine thread would hold device memory of a closed runtime)."""
    import gc

    from kvactors.kernels.fast import ScratchCache

    def caches() -> list[ScratchCache]:
        return [c for c in gc.get_objects() if type(c) is ScratchCache and c.allocations]

    before = {id(c) for c in caches()}
    with fake_vendor(kind, seed=1) as fake:
        src = [fake.adopt(t) for t in paged(3)]
        with Runtime(_backend(kind)) as rt:
            rt.transfer(request(Direction.D2H, IDS), src, objects(2))
            stats = rt.statistics()
            mine = [c for c in caches() if id(c) not in before]
            assert mine, "the call staged through a cache the runtime does not own"
            assert stats.scratch_allocations == sum(c.allocations for c in mine)
            del mine
        gc.collect()
        assert not [c for c in caches() if id(c) not in before]
