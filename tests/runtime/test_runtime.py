"""The runtime end to end on CPU: transfers through the actors, fences, threads, shutdown."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from kvactors.actors.gather import TransferOperands
from kvactors.actors.group import DeviceActors
from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.core.protocols.gather import Fence, Fenced, Transfer
from kvactors.errors import (
    ActorClosedError,
    DeadlineExceededError,
    DeviceOpError,
    IPCError,
    OperandTypeError,
    TransferAbandonedError,
    TransferValidationError,
)
from kvactors.kernels.reference import run_reference
from kvactors.runtime import Runtime
from kvactors.testing.manual import ManualBackend

NL, NB, BS, NH, HS = 3, 16, 4, 2, 8
BPO = 2  # blocks per object
T = BPO * BS


def _nhd(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(NL, 2, NB, BS, NH, HS, generator=g).to(dtype)
    return list(base.unbind(0))  # views of one allocation: the stacked fast path


def _mla(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, BS, HS, generator=g).to(torch.float16) for _ in range(NL)]


def _request(fmt: KVFormat, direction: Direction, ids: list[int], dtype: str) -> TransferRequest:
    mla = fmt == KVFormat.NL_X_NB_BS_HS
    shape = ShapeDesc(
        kv_size=1 if mla else 2,
        nl=NL,
        nb=NB,
        bs=BS,
        nh=1 if mla else NH,
        hs=HS,
        element_size=2,
        dtype=dtype,
    )
    return TransferRequest(
        fmt=int(fmt), direction=int(direction), block_ids=tuple(ids), chunk_size=T, shape=shape
    )


def _objects(fmt: KVFormat, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    if fmt == KVFormat.NL_X_NB_BS_HS:
        return [torch.full((NL, T, HS), -1, dtype=dtype) for _ in range(n)]
    return [torch.full((2, NL, T, NH * HS), -1, dtype=dtype) for _ in range(n)]


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [(KVFormat.NL_X_TWO_NB_BS_NH_HS, torch.bfloat16), (KVFormat.NL_X_NB_BS_HS, torch.float16)],
)
def test_gather_then_scatter_round_trip(fmt: KVFormat, dtype: torch.dtype) -> None:
    paged = _nhd(1, dtype) if fmt == KVFormat.NL_X_TWO_NB_BS_NH_HS else _mla(1)
    name = str(dtype).removeprefix("torch.")
    src_ids = [5, 1, 9, 12, 3]  # 2.5 objects: the third is partially covered
    with Runtime("cpu") as rt:
        objs = _objects(fmt, 3, dtype)
        done = rt.transfer(_request(fmt, Direction.D2H, src_ids, name), paged, objs)
        assert done.blocks == len(src_ids)
        # Oracle: the reference kernel on identical inputs.
        expect = _objects(fmt, 3, dtype)
        req = _request(fmt, Direction.D2H, src_ids, name)
        run_reference(plan_transfer(req, paged, expect, device_type="cpu"), paged, expect)
        for got, exp in zip(objs, expect, strict=True):
            assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
        # The uncovered tail of the last object stays untouched.
        assert bool(
            (
                objs[2].view(torch.int16)[..., BS:, :] == expect[2].view(torch.int16)[..., BS:, :]
            ).all()
        )
        # Scatter into fresh blocks of a zeroed cache.
        dst = [torch.zeros_like(t) for t in paged]
        dst_ids = [0, 2, 4, 6, 8]
        rt.transfer(_request(fmt, Direction.H2D, dst_ids, name), dst, objs)
        for layer in range(NL):
            for s, d in zip(src_ids, dst_ids, strict=True):
                if fmt == KVFormat.NL_X_NB_BS_HS:
                    assert torch.equal(dst[layer][d], paged[layer][s])
                else:
                    assert torch.equal(dst[layer][:, d], paged[layer][:, s])
            untouched = [b for b in range(NB) if b not in dst_ids]
            if fmt == KVFormat.NL_X_NB_BS_HS:
                assert not dst[layer][untouched].any()
            else:
                assert not dst[layer][:, untouched].any()
        stats = rt.statistics()
        assert stats.transfers_ok == 2
        assert stats.inflight == 0


def test_bad_request_fails_before_touching_memory() -> None:
    paged = _nhd(2)
    before = [t.clone() for t in paged]
    objs = _objects(KVFormat.NL_X_TWO_NB_BS_NH_HS, 1, torch.bfloat16)
    objs_before = [o.clone() for o in objs]
    with Runtime("cpu") as rt:
        with pytest.raises(TransferValidationError):
            rt.transfer(
                _request(KVFormat.NL_X_TWO_NB_BS_NH_HS, Direction.H2D, [0, NB], "bfloat16"),
                paged,
                objs,
            )
        with pytest.raises(TransferValidationError):
            rt.transfer(
                _request(KVFormat.NL_X_TWO_NB_BS_NH_HS, Direction.D2H, [0], "float16"),
                paged,
                objs,
            )
        with pytest.raises(OperandTypeError):
            rt.transfer(
                _request(KVFormat.NL_X_TWO_NB_BS_NH_HS, Direction.D2H, [0], "bfloat16"),
                paged,
                "not a list",  # type: ignore[arg-type]
            )
        assert rt.statistics().transfers_failed == 0
    for a, b in zip(paged, before, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(objs, objs_before, strict=True):
        assert torch.equal(a, b)


def test_four_threads_at_once() -> None:
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(3)
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    with Runtime("cpu") as rt:

        def worker(i: int) -> None:
            try:
                for rep in range(10):
                    ids = [(i * 4 + rep + k) % NB for k in range(4)]
                    objs = _objects(fmt, 2, torch.bfloat16)
                    rt.transfer(_request(fmt, Direction.D2H, ids, "bfloat16"), paged, objs)
                    exp = _objects(fmt, 2, torch.bfloat16)
                    req = _request(fmt, Direction.D2H, ids, "bfloat16")
                    run_reference(plan_transfer(req, paged, exp, device_type="cpu"), paged, exp)
                    assert all(torch.equal(a, b) for a, b in zip(objs, exp, strict=True))
                results[i] = objs
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(results) == 4
        assert rt.statistics().transfers_ok == 40


def test_closed_runtime_refuses_calls() -> None:
    rt = Runtime("cpu").start()
    rt.close()
    rt.close()  # idempotent
    with pytest.raises(ActorClosedError):
        rt.ping()
    with pytest.raises(ActorClosedError):
        rt.start()


def test_ask_past_deadline_keeps_operands_owned() -> None:
    backend = ManualBackend()
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(4)
    with Runtime(backend) as rt:
        objs = _objects(fmt, 1, torch.bfloat16)
        with pytest.raises(DeadlineExceededError):
            rt.transfer(_request(fmt, Direction.D2H, [1, 2], "bfloat16"), paged, objs, timeout=0.05)
        del objs, paged
        assert backend.queued() == 1
        backend.release()
        rt.synchronize()
        assert backend.use_after_free == 0


def test_shutdown_with_work_in_flight_fails_pending_calls_in_bounded_time() -> None:
    """F2: a close that gives up on an enqueued transfer says it may still land
    (``TransferAbandonedError``), never "not served" (``ActorClosedError``)."""
    backend = ManualBackend()
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(5)
    rt = Runtime(backend, stop_timeout=0.2).start()
    failures: list[BaseException] = []

    def caller() -> None:
        try:
            objs = _objects(fmt, 1, torch.bfloat16)
            rt.transfer(_request(fmt, Direction.D2H, [1], "bfloat16"), paged, objs, timeout=30)
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=caller)
    t.start()
    assert backend.wait_for(lambda b: b.queued() == 1)
    with pytest.raises(DeviceOpError, match="did not end"):  # the lane waits on the device
        rt.close(timeout=0.2)
    t.join(10)
    assert not t.is_alive()
    assert len(failures) == 1
    assert isinstance(failures[0], TransferAbandonedError)
    assert not isinstance(failures[0], ActorClosedError)
    assert "may still land" in str(failures[0])
    backend.release()  # the abandoned device work may still finish safely
    assert backend.use_after_free == 0


async def test_rule4_fence_waits_for_earlier_transfers_on_its_blocks() -> None:
    backend = ManualBackend()
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(6)
    async with DeviceActors(backend) as dev:
        objs = _objects(fmt, 1, torch.bfloat16)
        store = dev.gather.ask_nowait(
            Transfer(transfer_id=1, request=_request(fmt, Direction.D2H, [3, 7], "bfloat16")),
            TransferOperands(paged, objs),
        )
        fence = dev.gather.ask_nowait(Fence(block_ids=(7, 11)), timeout=10)
        other = await dev.gather.ask_nowait(
            Fence(block_ids=(11,))
        )  # blocks nobody touches: at once
        assert other == Fenced(block_ids=(11,), waited_for=0)
        ok = await asyncio.to_thread(backend.wait_for, lambda b: b.queued() == 1)
        assert ok
        assert not fence.done(), "fence answered while a gather of its blocks was in flight"
        # The engine would now reuse block 7; the KV must already be in the host chunk.
        backend.release()
        assert await fence == Fenced(block_ids=(7, 11), waited_for=1)
        assert store.done()
        assert torch.equal(objs[0][:, 0, BS:], paged[0][:, 7].reshape(2, BS, NH * HS))


async def test_async_api_from_another_loop() -> None:
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(7)
    with Runtime("cpu") as rt:
        objs = _objects(fmt, 1, torch.bfloat16)
        done = await rt.atransfer(_request(fmt, Direction.D2H, [2, 4], "bfloat16"), paged, objs)
        assert done.blocks == 2
        assert (await rt.afence([2, 4], timeout=10)).waited_for == 0
        assert (await rt.aping(5)).seq == 5


def test_statistics_count_stream_syncs_and_wait_time() -> None:
    backend = ManualBackend(auto=True)
    with Runtime(backend) as rt:
        assert rt.statistics().stream_syncs == 0
        rt.synchronize(0)
        rt.record_completion(0, "finish", b"p")
        rt.synchronize(0)
        stats = rt.statistics()
        assert stats.stream_syncs == 2  # a record marks the stream, it does not wait for it
        assert rt.drain_completions() == [("finish", b"p")]
        names = [a.name for a in stats.actors]
        assert names[:2] == ["gather:cpu:0", "ipc:cpu:0"]
        assert any(n.startswith("stream:cpu:0:") for n in names)


def test_f1_ipc_owner_kept_open_when_the_sync_before_its_close_times_out() -> None:
    """F1 (close after sync): a close whose stream barrier times out releases nothing; the
    error says the owners were kept and the statistics count them; a later close that syncs
    releases them."""
    backend = ManualBackend()  # the device runs nothing until released
    fmt = KVFormat.NL_X_TWO_NB_BS_NH_HS
    paged = _nhd(5)
    shared = backend.alloc_shared((16,), torch.float32)
    assert shared.tensor is not None
    rt = Runtime(backend, stop_timeout=0.2).start()
    try:
        rt.open_ipc(backend.ipc_export(shared.tensor), context_id=1)
        t = threading.Thread(
            target=rt.transfer,
            args=(
                _request(fmt, Direction.D2H, [1], "bfloat16"),
                paged,
                _objects(fmt, 1, torch.bfloat16),
            ),
        )
        t.start()
        assert backend.wait_for(lambda b: b.queued() == 1)  # the stream is busy with a copy
        with pytest.raises(IPCError, match="1 IPC owner\\(s\\) kept open") as info:
            rt.close_ipc_context(1)
        assert isinstance(info.value.__cause__, DeadlineExceededError)
        stats = rt.statistics()
        assert (stats.ipc_owners_kept, stats.ipc_owners_open, stats.ipc_owners_closed) == (1, 1, 0)
        assert backend.owners_closed == 0
        backend.release()
        t.join(10)
        assert rt.close_ipc_context(1).owners_closed == 1  # synced now: released
        stats = rt.statistics()
        assert (stats.ipc_owners_kept, stats.ipc_owners_open, stats.ipc_owners_closed) == (0, 0, 1)
    finally:
        backend.release()
        rt.close()
        shared.close()


def test_backends_declare_the_capabilities_the_actors_read() -> None:
    """The actors read a backend's declared capabilities: the CPU backend completes on
    launch; a subclass replacing launch (ManualBackend) does not, one adding layout rules or
    a native kernel says so, and only a plain backend runs the specialised kernel."""
    from kvactors.devices.cpu import CpuBackend
    from kvactors.testing.manual import ManualBackend

    class Rules(CpuBackend):
        def prepare_transfer(self, request: Any, paged: Any, objects: Any) -> Any:
            return request, paged, objects

    cpu, manual, rules = CpuBackend(), ManualBackend(), Rules()
    assert cpu.completes_on_launch
    assert cpu.plain_transfers
    assert not manual.completes_on_launch
    assert not manual.plain_transfers
    assert rules.completes_on_launch
    assert rules.prepares_transfers
    assert not rules.plain_transfers
