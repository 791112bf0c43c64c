"""Soak: 10,000 transfers with preemptions (fences + block reuse) and injected stream faults.

Stores and retrieves in flight through one :class:`kvactors.runtime.Runtime`, random
preemptions (``afence`` then overwrite) and, on the fake devices, a stream fault every
``--fault-every`` transfers; every store is checked bit-exact. Exits non-zero when RSS grew by
more than 10 % + 20 MB, fds grew, a store was corrupted or a fault went unreported. Usage::

    python benchmarks/soak.py [--device musa|mlu|cpu] [--transfers 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import random
import sys
import time
from typing import TYPE_CHECKING, Any

import psutil
import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices.mlu import MluBackend
from kvactors.errors import KvactorsError
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.devices.base import Backend

NL, NB, BS, NH, HS = 2, 64, 4, 2, 8
BPC = 2
CHUNK = BPC * BS
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


@dataclasses.dataclass
class Counters:
    """What the soak did and found."""

    transfers: int = 0
    stores: int = 0
    retrieves: int = 0
    fences: int = 0
    fences_waited: int = 0
    reused_blocks: int = 0
    faults_injected: int = 0
    faults_reported: int = 0
    faults_silent: int = 0  # an injected fault reported as success
    unexpected_failures: int = 0
    corrupted: int = 0


def _request(direction: Direction, ids: list[int]) -> TransferRequest:
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    return TransferRequest(
        fmt=int(FMT), direction=int(direction), block_ids=tuple(ids), chunk_size=CHUNK, shape=shape
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@contextlib.contextmanager
def device(kind: str, seed: int) -> Iterator[tuple[Any, torch.Tensor, Any, bool]]:
    """(paged operand, host alias [NL, 2, NB, BS, NH, HS], fake vendor or None, pinned?)."""
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(NL, 2, NB, BS, NH, HS, generator=g).to(torch.bfloat16)
    if kind == "cpu":
        yield list(host.unbind(0)), host, None, False
        return
    with fake_vendor(kind, seed=seed) as fake:
        yield [fake.adopt(t) for t in host.unbind(0)], host, fake, True


class Soak:
    """The engine loop."""

    def __init__(
        self,
        rt: Runtime,
        paged: Any,
        host: torch.Tensor,
        fake: Any,
        pinned: bool,
        seed: int,
        inflight: int,
        fault_every: int,
    ) -> None:
        self.rt, self.paged, self.host, self.fake = rt, paged, host, fake
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.inflight = inflight
        self.fault_every = fault_every if fake is not None else 0
        self.pool = [
            torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.bfloat16, pin_memory=pinned)
            for _ in range(2 * inflight + 2)
        ]
        self.committed: list[torch.Tensor] = []  # chunks holding verified KV (for retrieves)
        self.busy: set[int] = set()  # blocks being loaded or freed: not to be stored
        self.c = Counters()

    def _chunk(self, ids: list[int]) -> torch.Tensor:
        blocks = self.host[:, :, ids].permute(1, 0, 2, 3, 4, 5)
        return blocks.reshape(2, NL, len(ids) * BS, NH * HS).clone()

    async def _store(self, ids: list[int]) -> None:
        obj = self.pool.pop()
        expected = self._chunk(ids)  # the KV at submission: fenced blocks cannot change
        try:
            await self.rt.atransfer(_request(Direction.D2H, ids), self.paged, [obj])
        except KvactorsError:
            self.c.unexpected_failures += 1
            self.pool.append(obj)
            return
        if not torch.equal(_bits(obj), _bits(expected)):
            self.c.corrupted += 1
        self.committed.append(obj.clone())
        if len(self.committed) > 8:
            self.committed.pop(0)
        self.pool.append(obj)

    async def _retrieve(self, ids: list[int], chunk: torch.Tensor) -> None:
        try:
            await self.rt.atransfer(_request(Direction.H2D, ids), self.paged, [chunk])
        except KvactorsError:
            self.c.unexpected_failures += 1
        finally:
            self.busy.difference_update(ids)

    async def _preempt(self, ids: list[int]) -> None:
        # The blocks are freed: nothing new is submitted on them until they are reused.
        try:
            await self._fence_and_reuse(ids)
        finally:
            self.busy.difference_update(ids)

    async def _fence_and_reuse(self, ids: list[int]) -> None:
        fenced = await self.rt.afence(ids)
        self.c.fences += 1
        self.c.fences_waited += fenced.waited_for
        # The next request's forward pass overwrites the freed blocks.
        for b in ids:
            self.host[:, :, b].copy_(
                torch.randn(self.host[:, :, b].shape, generator=self.gen).to(torch.bfloat16)
            )
        self.c.reused_blocks += len(ids)

    async def _fault(self) -> None:
        # Drain first, so the error lands ahead of exactly one transfer.
        await asyncio.to_thread(self.rt.synchronize, 0)
        self.fake.inject_error(self.fake.default_stream(0), "injected soak fault")
        self.c.faults_injected += 1
        obj = self.pool.pop()
        try:
            await self.rt.atransfer(_request(Direction.D2H, [0, 1]), self.paged, [obj])
            self.c.faults_silent += 1
        except KvactorsError:
            self.c.faults_reported += 1
        finally:
            self.pool.append(obj)
        with contextlib.suppress(KvactorsError):
            await asyncio.to_thread(self.rt.synchronize, 0)  # reports and clears the error

    async def run(self, n: int) -> None:
        """Run ``n`` transfers (stores, retrieves and fault probes)."""
        tasks: set[asyncio.Task[None]] = set()
        while self.c.transfers < n:
            if len(tasks) >= self.inflight:
                _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            self.c.transfers += 1
            if self.fault_every and self.c.transfers % self.fault_every == 0:
                if tasks:
                    await asyncio.wait(tasks)
                    tasks = set()
                await self._fault()
                continue
            roll = self.rng.random()
            free = [b for b in range(NB) if b not in self.busy]
            ids = self.rng.sample(free, BPC)
            if roll < 0.1:
                self.c.transfers -= 1  # a fence is not a transfer
                self.busy.update(ids)
                tasks.add(asyncio.ensure_future(self._preempt(ids)))
            elif roll < 0.3 and self.committed:
                self.busy.update(ids)
                self.c.retrieves += 1
                tasks.add(asyncio.ensure_future(self._retrieve(ids, self.committed[-1])))
            else:
                self.c.stores += 1
                tasks.add(asyncio.ensure_future(self._store(ids)))
            await asyncio.sleep(0)  # post in order: a later fence is behind this transfer
        if tasks:
            await asyncio.wait(tasks)


def rss_mb() -> float:
    """Resident set size of this process in MiB."""
    return float(psutil.Process().memory_info().rss) / 2**20


def fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def _backend(kind: str) -> Backend | str:
    # The soak allocates real NHD memory: on MLU, format 1 is declared "resolved" (vLLM-MLU's
    # own HND caches would need "legacy"; see docs/guides/mlu.md).
    return MluBackend(layout_source="resolved") if kind == "mlu" else kind


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("musa", "mlu", "cpu"), default="musa")
    ap.add_argument("--transfers", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--fault-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with (
        device(args.device, args.seed) as (paged, host, fake, pinned),
        Runtime(_backend(args.device), default_timeout=60) as rt,
    ):
        soak = Soak(rt, paged, host, fake, pinned, args.seed, args.inflight, args.fault_every)
        asyncio.run(soak.run(args.warmup))
        gc.collect()
        rss0, fds0 = rss_mb(), fds()
        t0 = time.perf_counter()
        asyncio.run(soak.run(args.warmup + args.transfers))
        wall = time.perf_counter() - t0
        rt.synchronize(0)
        stats = rt.statistics()
        gc.collect()
        rss1, fds1 = rss_mb(), fds()
    c = soak.c
    done = c.transfers - args.warmup
    print(
        f"kvactors soak on {args.device}{' (fake vendor)' if fake is not None else ''}: "
        f"{done} transfers after {args.warmup} warm-up, seed {args.seed}"
    )
    print(
        f"  stores {c.stores}, retrieves {c.retrieves}, fences {c.fences} "
        f"(waited for {c.fences_waited} transfers), blocks reused {c.reused_blocks}"
    )
    print(
        f"  faults injected {c.faults_injected}, reported {c.faults_reported}, "
        f"silent {c.faults_silent}; unexpected failures {c.unexpected_failures}; "
        f"corrupted stores {c.corrupted}"
    )
    print(
        f"  runtime: ok {stats.transfers_ok}, failed {stats.transfers_failed}, "
        f"in flight {stats.inflight}, bytes {stats.bytes_moved}"
    )
    print(f"  throughput: {done / wall:.0f} transfers/s ({wall:.1f} s)")
    print(f"  RSS: {rss0:.1f} MiB -> {rss1:.1f} MiB ({rss1 - rss0:+.1f}); fds: {fds0} -> {fds1}")
    failures = []
    if rss1 > rss0 * 1.10 + 20:
        failures.append("RSS grew beyond noise (> 10 % + 20 MB)")
    if fds1 > fds0:
        failures.append("open fds grew")
    if c.corrupted:
        failures.append("corrupted stores")
    if c.faults_silent:
        failures.append("injected faults reported as success")
    if c.unexpected_failures:
        failures.append("transfers failed without an injected fault")
    print("  RESULT:", "OK" if not failures else "FAILED: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
