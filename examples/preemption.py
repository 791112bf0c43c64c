"""Preemption and block reuse while a store is in flight: the race, and the fence that ends it.

A small simulated serving engine (block allocator, requests with prompts, prefill and decode,
asynchronous stores of full chunks through kvactors, prefix-cache retrieves on resume, and
vLLM-style preemption that frees a request's blocks and hands them to another request *in the
same step*, which overwrites them) runs twice on the same seed:

* **naive**: stores are asynchronous and block reuse does not wait for them. A store that is
  still queued on the device when its blocks are rewritten copies the *other* request's KV and
  commits it under the old key (field-lessons 1.8: DingoCache#76, vllm#52360).
* **kvactors**: the same engine calls ``Runtime.afence(block_ids)`` before it reuses freed
  blocks; the fence answers only after every earlier transfer touching them completed.

After each run every committed chunk is compared with the KV it was stored from. The naive run
must show corrupted chunks, the kvactors run none. The device runs a few milliseconds behind
the host, as an accelerator does, so the race is reliable rather than lucky:

* ``--device cpu``: a CPU device whose stream lags (the deterministic fake
  :class:`kvactors.testing.ManualBackend`, stepped by a device-clock thread ``--lag-ms``
  behind the launch); the real CPU backend copies synchronously on its lane
  thread and would race only by chance.
* ``--device mlu`` / ``--device musa``: the fake vendor modules of :mod:`kvactors.testing`
  (asynchronous streams with a seeded per-op delay) when no hardware is present; on hardware,
  the engine's KV writes go to a separate compute stream, as a model's forward pass would.

Usage::

    python examples/preemption.py --device cpu --seed 1 --requests 24

Exits 0 when the kvactors run committed no corrupted chunk (and, with ``--require-race``,
only if the naive run did show corruption).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices import get_backend
from kvactors.runtime import Runtime
from kvactors.testing import ManualBackend, fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

# Model geometry: small, so a run takes a second or two.
NL, NB, BS, NH, HS = 2, 40, 4, 2, 16
BPC = 2  # blocks per chunk
CHUNK = BPC * BS  # tokens per chunk
DTYPE = torch.bfloat16

# The engine layout per device kind (vLLM NHD on CPU, vLLM-MLU HND, SGLang K/V lists on MUSA).
FORMATS = {
    "cpu": KVFormat.NL_X_TWO_NB_BS_NH_HS,
    "mlu": KVFormat.NL_X_TWO_NB_NH_BS_HS,
    "musa": KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
}


# ---- the device ---------------------------------------------------------------------------


class DeviceClock:
    """Runs a ManualBackend's queued work ``lag`` seconds after the host launched it.

    This is the simulated accelerator: launches return at once, and the work runs later on
    the device's own thread, so the host can overwrite memory a queued copy has yet to read.
    """

    def __init__(self, backend: ManualBackend, lag: float) -> None:
        self.backend = backend
        self.lag = lag
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-clock", daemon=True)

    def start(self) -> DeviceClock:
        """Start the device thread."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.backend.wait_for(lambda b: b.queued() > 0, timeout=0.05):
                continue
            time.sleep(self.lag)  # the device is this far behind the host
            self.backend.release(1)

    def stop(self) -> None:
        """Run whatever is still queued, then stop the device thread."""
        self._stop.set()
        self._thread.join(5.0)
        self.backend.release()


@dataclasses.dataclass
class Device:
    """Where the paged KV lives and how the engine's forward pass writes it."""

    kind: str
    description: str
    runtime: Runtime
    paged: Any  # the operand kvactors moves from/to
    canon: torch.Tensor  # [NL, 2, NB, BS, NH, HS] view the engine writes through
    pinned: bool
    compute_stream: Any = None  # hardware only: the forward pass's stream
    module: Any = None
    manual: ManualBackend | None = None

    def write_block(self, block: int, kv: torch.Tensor) -> None:
        """The forward pass writing ``kv`` (``[NL, 2, BS, NH, HS]``) into ``block``."""
        if self.compute_stream is None:
            # Simulated devices: the kernel has landed the moment the host returns (a compute
            # stream unordered with the transfer stream, and faster than it).
            self.canon[:, :, block].copy_(kv)
            return
        with self.module.stream(self.compute_stream):
            self.canon[:, :, block].copy_(kv.to(self.canon.device), non_blocking=True)

    def read_block(self, block: int) -> torch.Tensor:
        """The bytes of ``block`` as the device holds them now (``[NL, 2, BS, NH, HS]``)."""
        if self.compute_stream is not None:
            self.compute_stream.synchronize()
            self.module.synchronize()
            return self.canon[:, :, block].cpu()
        return self.canon[:, :, block].clone()

    def new_chunk(self) -> torch.Tensor:
        """A host chunk (pinned where the device can do asynchronous copies)."""
        shape = (2, NL, CHUNK, NH * HS)
        return torch.full(shape, -1, dtype=DTYPE, pin_memory=self.pinned)


def _backing(fmt: KVFormat, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One allocation holding every layer, and its canonical ``[NL, 2, NB, BS, NH, HS]`` view."""
    if fmt == KVFormat.NL_X_TWO_NB_BS_NH_HS:
        b = torch.zeros(NL, 2, NB, BS, NH, HS, dtype=DTYPE, device=device)
        return b, b
    if fmt == KVFormat.NL_X_TWO_NB_NH_BS_HS:
        b = torch.zeros(NL, 2, NB, NH, BS, HS, dtype=DTYPE, device=device)
        return b, b.transpose(3, 4)
    b = torch.zeros(2, NL, NB, BS, NH, HS, dtype=DTYPE, device=device)
    return b, b.transpose(0, 1)


def _paged(fmt: KVFormat, backing: torch.Tensor, adopt: Any = None) -> Any:
    wrap = adopt if adopt is not None else (lambda t: t)
    if fmt == KVFormat.TWO_X_NL_X_NB_BS_NH_HS:
        return [[wrap(backing[p, layer]) for layer in range(NL)] for p in range(2)]
    return [wrap(backing[layer]) for layer in range(NL)]


@contextlib.contextmanager
def open_device(kind: str, seed: int, lag: float) -> Iterator[Device]:
    """The device of one run: a lagging CPU, a fake vendor, or real hardware."""
    fmt = FORMATS[kind]
    if kind == "cpu":
        manual = ManualBackend()
        clock = DeviceClock(manual, lag).start()
        backing, canon = _backing(fmt)
        rt = Runtime(manual, default_timeout=60).start()
        try:
            yield Device(
                kind=kind,
                description=f"cpu (ManualBackend stream {lag * 1e3:.0f} ms behind the host)",
                runtime=rt,
                paged=_paged(fmt, backing),
                canon=canon,
                pinned=False,
                manual=manual,
            )
        finally:
            clock.stop()
            rt.close()
        return
    if get_backend(kind).probe().available:  # pragma: no cover - needs the hardware
        module = getattr(torch, kind)
        backing, canon = _backing(fmt, device=f"{kind}:0")
        rt = Runtime(kind, default_timeout=60).start()
        try:
            yield Device(
                kind=kind,
                description=f"{kind}:0 (hardware; forward on its own compute stream)",
                runtime=rt,
                paged=_paged(fmt, backing),
                canon=canon,
                pinned=True,
                compute_stream=module.Stream(),
                module=module,
            )
        finally:
            rt.close()
        return
    with fake_vendor(kind, seed=seed, delay=lag, jitter=lag / 2) as fake:
        backing, canon = _backing(fmt)
        rt = Runtime(kind, default_timeout=60).start()
        try:
            yield Device(
                kind=kind,
                description=f"fake {kind} (kvactors.testing; {lag * 1e3:.0f} ms per device op)",
                runtime=rt,
                paged=_paged(fmt, backing, fake.adopt),
                canon=canon,  # the host alias of the fake device memory
                pinned=True,
            )
        finally:
            rt.close()


# ---- the engine ---------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    """One request: its prompt and the KV every token has (deterministic per seed)."""

    rid: int
    prompt_len: int
    total_len: int
    kv: torch.Tensor  # [total_len rounded up to a chunk, NL, 2, NH, HS]
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the blocks
    stored: int = 0  # chunks whose store was submitted
    preemptions: int = 0

    def block_kv(self, j: int) -> torch.Tensor:
        """The KV of the request's ``j``-th block as ``[NL, 2, BS, NH, HS]``."""
        return self.kv[j * BS : (j + 1) * BS].permute(1, 2, 0, 3, 4)

    def chunk_kv(self, c: int) -> torch.Tensor:
        """The host chunk chunk ``c`` must hold: ``[2, NL, CHUNK, NH*HS]``."""
        toks = self.kv[c * CHUNK : (c + 1) * CHUNK]
        return toks.permute(2, 1, 0, 3, 4).reshape(2, NL, CHUNK, NH * HS)


@dataclasses.dataclass
class Stats:
    """What one run did and found."""

    steps: int = 0
    stores: int = 0
    committed: int = 0
    failed: int = 0
    corrupted: int = 0
    retrieves: int = 0
    resumed_wrong: int = 0
    preemptions: int = 0
    reused_in_step: int = 0
    fences: int = 0
    fences_waited: int = 0
    use_after_free: int = 0
    wall: float = 0.0


@dataclasses.dataclass
class _Store:
    req: Request
    chunk: int
    obj: torch.Tensor
    task: asyncio.Task[Any]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


class Engine:
    """A vLLM-shaped scheduler loop over a fixed block pool, with kvactors stores."""

    def __init__(self, dev: Device, requests: list[Request], seed: int, *, fence: bool) -> None:
        self.dev = dev
        self.rt = dev.runtime
        self.fmt = FORMATS[dev.kind]
        self.fence = fence
        self.rng = random.Random(seed ^ 0x5EED)
        self.free: list[int] = list(range(NB - 1, -1, -1))  # a stack: freed blocks reused first
        self.waiting: list[Request] = list(requests)
        self.running: list[Request] = []
        self.cache: dict[tuple[int, int], torch.Tensor] = {}  # committed chunks (rid, chunk)
        self.stores: list[_Store] = []
        self.stats = Stats()
        self._freed_this_step: set[int] = set()
        self._preempted_now: set[int] = set()

    def _request(self, direction: Direction, block_ids: list[int]) -> TransferRequest:
        shape = ShapeDesc(
            kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
        )
        return TransferRequest(
            fmt=int(self.fmt),
            direction=int(direction),
            block_ids=tuple(block_ids),
            chunk_size=CHUNK,
            shape=shape,
        )

    # -- blocks ----------------------------------------------------------------------

    async def _wait_stores(self, req: Request) -> None:
        # vLLM delays freeing a *finished* request's blocks until the connector reports its
        # saves done (request_finished -> get_finished); a preempted request has no such
        # hook, which is the whole problem. Resume lookups also wait for the request's own
        # stores, so both runs see the same cache hits and take the same decisions.
        tasks = [s.task for s in self.stores if s.req is req and not s.task.done()]
        if tasks:
            await asyncio.wait(tasks)

    async def _release_blocks(self, req: Request) -> None:
        blocks, req.blocks = req.blocks, []
        if self.fence and blocks:
            # Rule 4: every store already submitted on these blocks finishes first.
            fenced = await self.rt.afence(blocks)
            self.stats.fences += 1
            self.stats.fences_waited += fenced.waited_for
        self._freed_this_step.update(blocks)
        self.free.extend(reversed(blocks))

    async def _allocate(self, req: Request, n: int, *, preempt: bool) -> bool:
        while len(self.free) < n:
            victims = [r for r in self.running if r is not req]
            if not preempt or not victims:
                return False
            await self._preempt(victims[-1])  # vLLM preempts the most recently admitted
        for _ in range(n):
            b = self.free.pop()
            if b in self._freed_this_step:
                self.stats.reused_in_step += 1
            req.blocks.append(b)
        return True

    async def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._preempted_now.add(req.rid)
        await self._release_blocks(req)
        req.computed = 0
        req.stored = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.insert(0, req)

    # -- forward, stores, retrieves --------------------------------------------------

    def _forward(self, req: Request, upto: int) -> None:
        """Compute tokens ``[req.computed, upto)``: write the KV of the blocks they touch."""
        first, last = req.computed // BS, (upto - 1) // BS
        for j in range(first, last + 1):
            # Whole-block writes are what a kernel does to a fresh block; the KV of a
            # partially filled block's later slots is simply not read by anyone yet.
            self.dev.write_block(req.blocks[j], req.block_kv(j))
        req.computed = upto

    async def _submit_stores(self, req: Request) -> None:
        while (req.stored + 1) * CHUNK <= req.computed:
            c = req.stored
            obj = self.dev.new_chunk()
            ids = req.blocks[c * BPC : (c + 1) * BPC]
            task = asyncio.ensure_future(self._store(req.rid, c, ids, obj))
            # One yield lets the task post its Transfer: mailbox order is submission order,
            # so a later fence on these blocks is behind this store.
            await asyncio.sleep(0)
            self.stores.append(_Store(req, c, obj, task))
            req.stored += 1
            self.stats.stores += 1

    async def _store(self, rid: int, chunk: int, ids: list[int], obj: torch.Tensor) -> None:
        # The transfer is posted in this coroutine's first step (before its first await).
        await self.rt.atransfer(self._request(Direction.D2H, ids), self.dev.paged, [obj])
        # LMCache commits a store once its transfer reported done; a failed one never is.
        self.cache.setdefault((rid, chunk), obj)

    async def _admit(self, req: Request) -> bool:
        need = -(-req.prompt_len // BS)
        if len(self.free) < need:
            return False
        await self._wait_stores(req)
        # Admission never preempts (vLLM admits only into free blocks); decode does.
        if not await self._allocate(req, need, preempt=False):
            return False
        hits = 0
        while (req.rid, hits) in self.cache and (hits + 1) * CHUNK <= req.prompt_len:
            hits += 1
        if hits:
            # Prefix-cache hit: load the stored chunks instead of recomputing them.
            objs = [self.cache[(req.rid, c)] for c in range(hits)]
            ids = req.blocks[: hits * BPC]
            await self.rt.atransfer(self._request(Direction.H2D, ids), self.dev.paged, objs)
            self.stats.retrieves += 1
            wrong = any(
                not torch.equal(_bits(self.dev.read_block(b)), _bits(req.block_kv(j)))
                for j, b in enumerate(ids)
            )
            self.stats.resumed_wrong += int(wrong)
            req.computed = hits * CHUNK
            req.stored = hits
        self._forward(req, req.prompt_len)
        self.running.append(req)
        return True

    # -- the loop --------------------------------------------------------------------

    async def step(self) -> None:
        """One scheduler step: maybe preempt, admit, decode, then submit stores."""
        self._freed_this_step = set()
        self._preempted_now = set()
        if self.running and self.rng.random() < 0.25:
            await self._preempt(self.running[-1])  # the most recently admitted, as vLLM
        admitted: list[Request] = []
        for req in list(self.waiting):
            if req.rid in self._preempted_now:
                continue  # a request preempted in this step is not rescheduled in it
            if not await self._admit(req):
                break
            self.waiting.remove(req)
            admitted.append(req)
        for req in list(self.running):
            if req in admitted or req not in self.running:
                continue
            if req.computed >= req.total_len:
                continue
            if req.computed % BS == 0 and not await self._allocate(req, 1, preempt=True):
                continue
            if req in self.running:
                self._forward(req, req.computed + 1)
        for req in list(self.running):
            await self._submit_stores(req)
            if req.computed >= req.total_len:
                self.running.remove(req)
                await self._wait_stores(req)
                await self._release_blocks(req)
        self.stats.steps += 1

    async def run(self, max_steps: int = 10_000) -> Stats:
        """Run until every request finished, then check every committed chunk."""
        t0 = time.perf_counter()
        while (self.waiting or self.running) and self.stats.steps < max_steps:
            await self.step()
        for s in self.stores:
            try:
                await s.task
            except Exception:
                self.stats.failed += 1  # reported as a failure: never committed
                continue
            self.stats.committed += 1
            if not torch.equal(_bits(s.obj), _bits(s.req.chunk_kv(s.chunk))):
                self.stats.corrupted += 1
        await asyncio.to_thread(self.rt.synchronize)
        self.stats.wall = time.perf_counter() - t0
        if self.dev.manual is not None:
            self.stats.use_after_free = self.dev.manual.use_after_free
        return self.stats


def make_requests(seed: int, n: int) -> list[Request]:
    """``n`` requests with seeded prompt lengths, decode lengths and KV."""
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        prompt = rng.randint(CHUNK + 1, 4 * CHUNK)
        total = prompt + rng.randint(2, 2 * BS)
        g = torch.Generator().manual_seed(seed * 100_003 + rid)
        padded = -(-total // CHUNK) * CHUNK  # whole blocks and chunks
        kv = torch.randn(padded, NL, 2, NH, HS, generator=g).to(DTYPE)
        out.append(Request(rid=rid, prompt_len=prompt, total_len=total, kv=kv))
    return out


def run_once(
    kind: str, seed: int, n_requests: int, lag: float, *, fence: bool
) -> tuple[Stats, str]:
    """One full engine run on a fresh device: its statistics and the device's description."""
    with open_device(kind, seed, lag) as dev:
        engine = Engine(dev, make_requests(seed, n_requests), seed, fence=fence)
        return asyncio.run(engine.run()), dev.description


def summary(kind: str, desc: str, seed: int, n: int, naive: Stats, safe: Stats) -> str:
    """The side-by-side report of both runs."""
    rows = [
        ("scheduler steps", naive.steps, safe.steps),
        ("preemptions", naive.preemptions, safe.preemptions),
        ("blocks reused in the step they were freed", naive.reused_in_step, safe.reused_in_step),
        ("stores submitted", naive.stores, safe.stores),
        ("stores committed", naive.committed, safe.committed),
        ("stores failed (reported)", naive.failed, safe.failed),
        ("fences (of which waited for a store)", "-", f"{safe.fences} ({safe.fences_waited})"),
        ("prefix-cache retrieves on resume", naive.retrieves, safe.retrieves),
        ("CORRUPTED committed chunks", naive.corrupted, safe.corrupted),
        ("resumed requests with wrong KV", naive.resumed_wrong, safe.resumed_wrong),
        ("wall time [s]", f"{naive.wall:.2f}", f"{safe.wall:.2f}"),
    ]
    lines = [
        f"kvactors preemption race: device={kind} seed={seed} requests={n}",
        f"  device: {desc}",
        f"  {'':44} {'naive (no fence)':>17} {'kvactors (fence)':>17}",
    ]
    lines += [f"  {name:44} {a!s:>17} {b!s:>17}" for name, a, b in rows]
    if safe.use_after_free or naive.use_after_free:
        lines.append(
            f"  device work lost to freed operands: {naive.use_after_free} / {safe.use_after_free}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the naive and the fenced engine on one seed; print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "mlu", "musa"), default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--lag-ms", type=float, default=2.0, help="how far the device runs behind")
    ap.add_argument(
        "--require-race", action="store_true", help="also fail when the naive run is clean"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lag = args.lag_ms / 1e3
    naive, _ = run_once(args.device, args.seed, args.requests, lag, fence=False)
    safe, desc = run_once(args.device, args.seed, args.requests, lag, fence=True)
    print(summary(args.device, desc, args.seed, args.requests, naive, safe))
    ok = safe.corrupted == 0 and safe.resumed_wrong == 0 and safe.failed == 0
    ok = ok and safe.use_after_free == 0
    if naive.corrupted == 0:
        print(
            "  !!! WARNING: the naive run committed no corrupted chunk on this seed: the race "
            "did not fire (try more --requests or a larger --lag-ms)",
            file=sys.stderr,
        )
        if args.require_race:
            ok = False
    print(
        "  RESULT: "
        + (
            f"naive run committed {naive.corrupted} corrupted chunk(s); "
            f"kvactors run committed none. OK"
            if ok
            else "FAILED: the fenced run is not clean"
            if safe.corrupted or safe.failed or safe.resumed_wrong or safe.use_after_free
            else "FAILED: the naive run showed no corruption (--require-race)"
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
