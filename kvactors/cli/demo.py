"""``kvactors demo``: a simulated serving workload through the runtime, verified bit for bit.

A small engine (one asyncio task) admits requests into a paged KV pool, retrieves cached
prefix chunks (scatter), writes the rest and stores new chunks (gather) without waiting; a
chunk is visible to lookups only once its store completed and verified. Finished or preempted
requests free their blocks only after ``fence(blocks)``, then overwrite them with poison, so a
fence that did not wait would show as poison in stored chunks. Every restored block and stored
chunk is compared with the KV its key defines (:mod:`kvactors.cli._workload`).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.actors.group import DeviceStatistics
from kvactors.cli._devenv import device_env
from kvactors.cli._workload import Geometry, Request, chunk_content, chunk_object, make_requests
from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.errors import InvalidSettingError
from kvactors.observe.kvdump import KVDump, compare_kv
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.cli._devenv import DeviceEnv
    from kvactors.core.protocols.gather import TransferDone

__all__ = ("DemoConfig", "DemoReport", "run_demo")


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kvactors demo`` runs."""

    device: str = "cpu"
    requests: int = 300
    seed: int = 0
    geometry: Geometry = msgspec.field(default_factory=Geometry)
    store_capacity: int = 96
    """Host store size in chunks (LRU)."""
    max_running: int = 4
    preempt_rate: float = 0.2
    skip_fences: bool = False
    """Negative control: release blocks without fencing them (the demo should then FAIL)."""


class DemoReport(msgspec.Struct, kw_only=True):
    """What the demo did and whether everything verified."""

    device: str
    note: str
    requests: int = 0
    preemptions: int = 0
    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    retrieves: int = 0
    stores: int = 0
    fences: int = 0
    blocks_restored: int = 0
    blocks_verified: int = 0
    block_mismatches: int = 0
    chunks_stored: int = 0
    chunk_mismatches: int = 0
    transfer_errors: list[str] = msgspec.field(default_factory=list)
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    seconds: float = 0.0
    busy_seconds: float = 0.0
    """Wall time during which at least one transfer was in flight."""
    statistics: DeviceStatistics | None = None

    @property
    def ok(self) -> bool:
        """Every restored block and stored chunk matched and no transfer failed."""
        failed = self.statistics.transfers_failed if self.statistics is not None else 0
        return (
            self.block_mismatches == 0
            and self.chunk_mismatches == 0
            and not self.transfer_errors
            and failed == 0
            and self.blocks_verified == self.blocks_restored
        )


class _Engine:
    """The simulated engine: block allocator, host store, admission, preemption."""

    def __init__(self, rt: Runtime, env: DeviceEnv, cfg: DemoConfig, report: DemoReport) -> None:
        self.rt, self.env, self.cfg, self.report = rt, env, cfg, report
        g = self.geo = cfg.geometry
        self.backing = env.zeros(g.pool_shape, g.torch_dtype)
        self.paged = list(self.backing.unbind(0))
        self.shape = ShapeDesc(
            kv_size=2,
            nl=g.num_layers,
            nb=g.num_blocks,
            bs=g.block_size,
            nh=g.num_heads,
            hs=g.head_size,
            element_size=torch.empty(0, dtype=g.torch_dtype).element_size(),
            dtype=g.dtype,
        )
        self.rng = random.Random(cfg.seed)
        self.free = list(range(g.num_blocks))
        self.rng.shuffle(self.free)
        self.store: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self.storing: set[asyncio.Task[None]] = set()
        self.running: collections.deque[Request] = collections.deque()
        self.inflight = 0
        self.busy_since = 0.0
        self.poison = env.to_device(
            torch.full((g.num_layers, 2, 1, *g.pool_shape[3:]), -1, dtype=torch.int16).view(
                g.torch_dtype
            )
        )

    # ---- the engine's own device reads and writes (outside the runtime) -----------

    def _write(self, blocks: list[int], data: torch.Tensor) -> None:
        self.backing[:, :, torch.tensor(blocks)] = self.env.to_device(data)
        self.env.synchronize()

    def _read(self, blocks: list[int]) -> torch.Tensor:
        return self.backing[:, :, torch.tensor(blocks)].cpu()

    def _request(self, direction: Direction, blocks: list[int]) -> TransferRequest:
        return TransferRequest(
            fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
            direction=int(direction),
            block_ids=tuple(blocks),
            chunk_size=self.geo.chunk_tokens,
            shape=self.shape,
        )

    def _submit(
        self, direction: Direction, blocks: list[int], objects: list[torch.Tensor]
    ) -> asyncio.Future[TransferDone]:
        # Queues the transfer now (mailbox order = call order) and accounts the time during
        # which any transfer is in flight (the runtime's busy time).
        if self.inflight == 0:
            self.busy_since = time.perf_counter()
        self.inflight += 1
        try:
            fut = asyncio.ensure_future(
                self.rt.atransfer(self._request(direction, blocks), self.paged, objects)
            )
        except BaseException:
            self._settled()
            raise
        fut.add_done_callback(lambda _f: self._settled())
        return fut

    def _settled(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.report.busy_seconds += time.perf_counter() - self.busy_since

    async def _transfer(
        self, direction: Direction, blocks: list[int], objects: list[torch.Tensor]
    ) -> int:
        return (await self._submit(direction, blocks, objects)).nbytes

    def _blocks_of(self, req: Request, i: int) -> list[int]:
        cb = self.geo.chunk_blocks
        return req.blocks[i * cb : (i + 1) * cb]

    # ---- serving ----------------------------------------------------------------

    async def serve(self, requests: list[Request]) -> None:
        queue = collections.deque(requests)
        while queue:
            req = queue.popleft()
            need = len(req.keys) * self.geo.chunk_blocks
            while len(self.free) < need or len(self.running) >= self.cfg.max_running:
                await self._release(self.running.popleft())
                self.report.requests += 1
            await self._admit(req)
            self.running.append(req)
            if self.rng.random() < self.cfg.preempt_rate:
                victim = self.running[self.rng.randrange(len(self.running))]
                self.running.remove(victim)
                await self._release(victim)
                self.report.preemptions += 1
                queue.insert(min(len(queue), self.rng.randint(1, 4)), victim)
        while self.running:
            await self._release(self.running.popleft())
            self.report.requests += 1
        if self.storing:
            await asyncio.gather(*self.storing)

    async def _admit(self, req: Request) -> None:
        g, report = self.geo, self.report
        report.lookups += 1
        hits = 0
        for key in req.keys:
            if key not in self.store:
                break
            self.store.move_to_end(key)
            hits += 1
        report.hit_chunks += hits
        report.miss_chunks += len(req.keys) - hits
        req.blocks = [self.free.pop() for _ in range(len(req.keys) * g.chunk_blocks)]
        if hits:
            await self._retrieve(req, hits)
        for i in range(hits, len(req.keys)):
            self._write(self._blocks_of(req, i), chunk_content(req.keys[i], g))
        if hits < len(req.keys):
            self._begin_store(req, hits)

    async def _retrieve(self, req: Request, hits: int) -> None:
        g, report = self.geo, self.report
        blocks = req.blocks[: hits * g.chunk_blocks]
        objects = [self.store[k] for k in req.keys[:hits]]
        try:
            nbytes = await self._transfer(Direction.H2D, blocks, objects)
        except Exception as exc:
            report.transfer_errors.append(f"retrieve: {type(exc).__name__}: {exc}")
            return
        report.retrieves += 1
        report.bytes_h2d += nbytes
        report.blocks_restored += len(blocks)
        got = self._read(blocks)
        want = torch.cat([chunk_content(k, g) for k in req.keys[:hits]], dim=2)
        result = compare_kv(
            KVDump(tuple(blocks), list(want.unbind(0)), 1),
            KVDump(tuple(blocks), list(got.unbind(0)), 1),
        )
        bad = _bad_positions(result.mismatches)
        report.block_mismatches += len(bad)
        report.blocks_verified += len(blocks) - len(bad)

    def _begin_store(self, req: Request, start: int) -> None:
        # Submitted here, before any later fence (see the module doc); verified by a task.
        g = self.geo
        keys = req.keys[start:]
        blocks = req.blocks[start * g.chunk_blocks :]
        objects = [
            self.rt.backend.pin(torch.empty(g.object_shape, dtype=g.torch_dtype)) for _ in keys
        ]
        try:
            submitted = self._submit(Direction.D2H, blocks, objects)
        except Exception as exc:
            self.report.transfer_errors.append(f"store: {type(exc).__name__}: {exc}")
            return
        task = asyncio.ensure_future(self._store(keys, objects, submitted))
        self.storing.add(task)
        task.add_done_callback(self.storing.discard)

    async def _store(
        self, keys: list[int], objects: list[torch.Tensor], submitted: asyncio.Future[TransferDone]
    ) -> None:
        g, report = self.geo, self.report
        try:
            nbytes = (await submitted).nbytes
        except Exception as exc:
            report.transfer_errors.append(f"store: {type(exc).__name__}: {exc}")
            return
        report.stores += 1
        report.bytes_d2h += nbytes
        for key, obj in zip(keys, objects, strict=True):
            want = chunk_object(chunk_content(key, g), g)
            if torch.equal(want.view(torch.int16), obj.view(torch.int16)):
                report.chunks_stored += 1
                self.store[key] = obj
                self.store.move_to_end(key)
                while len(self.store) > self.cfg.store_capacity:
                    self.store.popitem(last=False)
            else:
                report.chunk_mismatches += 1

    async def _release(self, req: Request) -> None:
        # Fence first (rule 4), then reuse: poison the blocks as the next prefill would.
        if not self.cfg.skip_fences:
            await self.rt.afence(req.blocks)
            self.report.fences += 1
        if req.blocks:
            self.backing[:, :, torch.tensor(req.blocks)] = self.poison
            self.env.synchronize()
        self.free.extend(req.blocks)
        req.blocks = []


def _bad_positions(mismatches: list[Any]) -> set[int]:
    return {m.position for m in mismatches}


def run_demo(cfg: DemoConfig, *, attach: Callable[[Runtime], Any] | None = None) -> DemoReport:
    """Run the simulated workload; see the module docstring.

    Args:
        cfg: The configuration.
        attach: Called with the started runtime before the workload (observers, tracing).

    Returns:
        The report, with a statistics snapshot of every actor taken at the end.

    Raises:
        BackendUnavailableError: the device cannot run here (and no fake can stand in).
    """
    geo = cfg.geometry
    if geo.num_blocks < cfg.max_running * 6 * geo.chunk_blocks:
        raise InvalidSettingError(
            "geometry.num_blocks too small for max_running requests", setting="geometry.num_blocks"
        )
    with device_env(cfg.device, seed=cfg.seed) as env:
        report = DemoReport(device=cfg.device, note=env.note)
        requests = list(make_requests(cfg.requests, seed=cfg.seed))
        with Runtime(env.backend(), default_timeout=60.0) as rt:
            if attach is not None:
                attach(rt)
            engine = _Engine(rt, env, cfg, report)
            t0 = time.perf_counter()
            asyncio.run(engine.serve(requests))
            report.seconds = time.perf_counter() - t0
            report.statistics = rt.statistics()
    return report
