"""Block ids reach the device without a host wait: a call with new block ids uploads them
with ONE ``non_blocking`` copy from pinned memory on the call's stream, where the old route
(a pageable upload) made the host wait for the stream; later calls reuse the upload, in
stream order; and a failed transfer makes its stream forget what it uploaded.

Counts come from the fake vendors' device-operation counters; order from the fake's ``delay``
knob (every work item runs late, so the host enqueues the next calls, and would overwrite an
upload's source, before the upload ran).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvactors.cli.bench.vendor import pool
from kvactors.core.layouts import Direction
from kvactors.devices.mlu import MluBackend
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests._device_actors import started_actors
from tests.scenarios._kv import BPC, NB, expected_gather, objects, paged, request, same

KINDS = ["mlu", "musa"]
BACKGROUND_SYNCS = 1  # per call: the stream lane's reaper waits for the launch's marker


def _backend(kind: str) -> Any:
    # The pool's operands are real NHD memory: on MLU, format 1 is declared resolved.
    return MluBackend(layout_source="resolved") if kind == "mlu" else kind


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_new_block_ids_cost_one_upload_and_no_host_wait(kind: str, direction: str) -> None:
    with fake_vendor(kind) as fake, Runtime(_backend(kind), default_timeout=60.0) as rt:
        p = pool(fake, "nhd")
        d = 1 if direction == "gather" else 0
        handle = rt.backend.current_stream_handle(0)

        def call(ids: tuple[int, ...]) -> None:
            rt.transfer(p.request(d, ids), p.paged, p.objects, stream_handle=handle, complete=False)

        call(tuple(range(0, 16, 2)))  # warm: the plan, the staging buffers
        fake.synchronize()
        rt.fence(range(64))
        with fake.counting() as ops:
            call(tuple(range(1, 17, 2)))  # ids this stream never uploaded
            rt.fence(range(64))  # until the runtime saw the device finish
        in_call = ops.counts
        fake.synchronize()
        chunk_copies = 2  # two chunks a call, one host<->device copy each
        if direction == "gather":
            assert (in_call.h2d, in_call.d2h) == (1, chunk_copies), in_call
        else:
            assert (in_call.h2d, in_call.d2h) == (1 + chunk_copies, 0), in_call
        # The one host wait is the reaper's, off the call's path: it learns that the launch
        # finished (to drop the operands and answer the fence).
        assert in_call.syncs == BACKGROUND_SYNCS, f"the call waited for its stream: {in_call}"
        with fake.counting() as ops:
            call(tuple(range(1, 17, 2)))  # the same ids again: on the device already
            again = ops.counts
        fake.synchronize()
        assert again.h2d == (0 if direction == "gather" else chunk_copies), again


@pytest.mark.parametrize("kind", KINDS)
def test_uploads_that_have_not_run_yet_serve_later_calls_in_stream_order(kind: str) -> None:
    """Every work item runs late: every gather below (new ids, then ids whose upload has not
    run yet) is enqueued behind uploads that have not run, and each chunk still holds
    exactly its blocks once the stream ran."""
    rng = random.Random(7)
    src = paged(5)
    with fake_vendor(kind, delay=0.02) as fake, Runtime(_backend(kind)) as rt:
        dev = [fake.adopt(t) for t in src]
        handle = rt.backend.current_stream_handle(0)
        sets = [tuple(rng.sample(range(NB), 2 * BPC)) for _ in range(6)]
        outs = []
        for ids in sets + sets[:3]:
            got = [o.pin_memory() for o in objects(2)]
            rt.transfer(request(Direction.D2H, ids), dev, got, stream_handle=handle, complete=False)
            outs.append((ids, got))
        fake.synchronize()
        rt.fence(range(NB))
        for ids, got in outs:
            for g, w in zip(got, expected_gather(src, ids), strict=True):
                assert same(g, w), f"ids {ids}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["nhd", "mla"])
def test_a_warm_call_neither_plans_nor_binds(
    kind: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned and bound once on an accelerator: after the first call of an operand set,
    calls with other block ids only rebind the plan's ids (no full validation) and run the
    entry's staged binding, made once; another pool (other operands) plans and binds anew."""
    from kvactors.kernels._bound import StagedBinding

    started = started_actors(monkeypatch)
    with fake_vendor(kind) as fake, Runtime(_backend(kind), default_timeout=60.0) as rt:
        handle = rt.backend.current_stream_handle(0)
        (actors,) = started
        plans = actors.gather.plans

        def run(p: Any, ids: tuple[int, ...]) -> None:
            rt.transfer(p.request(1, ids), p.paged, p.objects, stream_handle=handle)

        p = pool(fake, layout)
        run(p, tuple(range(0, 16, 2)))
        (entry,) = plans._entries.values()
        binding = entry.memo.staged
        assert isinstance(binding, StagedBinding)
        before = rt.statistics()
        for ids in (tuple(range(1, 17, 2)), tuple(range(16, 32, 2)), tuple(range(0, 16, 2))):
            run(p, ids)
        after = rt.statistics()
        full = (after.plans_validated - after.plans_rebound) - (
            before.plans_validated - before.plans_rebound
        )
        assert full == 0, "a warm call validated its operands in full"
        assert after.plans_rebound - before.plans_rebound == 3
        assert entry.memo.staged is binding, "a warm call bound its kernel again"
        other = pool(fake, layout)  # other memory: another key
        run(other, tuple(range(0, 16, 2)))
        assert len(plans._entries) == 2
        assert (
            rt.statistics().plans_validated - rt.statistics().plans_rebound
            == after.plans_validated - after.plans_rebound + 1
        )
        fresh = next(e for e in plans._entries.values() if e is not entry)
        assert isinstance(fresh.memo.staged, StagedBinding)
        assert fresh.memo.staged is not binding
