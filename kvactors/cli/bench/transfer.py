"""One-chunk calls through :class:`~kvactors.runtime.Runtime` against the link and against
torch itself, on any device (CPU, the fake vendors, CUDA).

Operands per layout: a paged pool (bf16, blocks of 16; ``8b``: 32 layers, 8 KV heads of 128,
MLA one 576-wide head), one host chunk of 256 tokens per caller (pinned where torch can pin),
the pool's blocks shuffled once and cut into sets of 16, so no block recurs within a
caller's cycle of sets. 1 and 4 caller threads, each on its own stream with its own chunk
and sets; every call is followed by a synchronize of its stream. Contenders, identical
operands, windows rotated (:mod:`._harness`):

* ``raw``: one copy of the chunk's bytes between a device buffer and the chunk;
* ``bare``: torch alone, block ids already on the device: one ``index_select`` of the stacked
  pool into a device staging buffer, one non-blocking copy into the chunk (scatter: the copy,
  then ``index_copy_``); absent for ``nhd_separate`` (no stacked pool);
* ``kvactors``: ``Runtime.transfer`` on the caller's stream (returns once complete);
* ``kvactors_async``: the same with ``complete=False`` (returns once enqueued, as LMCache's
  ops do);
* ``lmcache`` (CPU only): LMCache's torch path on the same request (its ids fixed).

Per contender and thread count (:class:`ChunkTiming`): host time until the call returned and
until its stream's synchronize returned, aggregate calls/s and GB/s; at one thread also the
device's time between timing events recorded before and after the call, in a pass of its own
after the timed windows (devices with timing events; None on CPU): no event is recorded in a
timed window, since on a fake stream an event is work of its own. ``busy_us``: the device's
own time for one call's work: the same events with the stream held by a spin kernel while
the host enqueues, so host gaps are left out (CUDA's ``_sleep``; elsewhere None). Each case
first checks that kvactors and the bare route move the same bytes (``exact``).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.cli.bench._harness import Lane, baseline, rates, table
from kvactors.cli.bench._pools import Pool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.cli._devenv import DeviceEnv
    from kvactors.runtime import Runtime

__all__ = ("ChunkTiming", "TransferRow", "block_sets", "format_transfer", "run_transfer")

THREADS = (1, 4)
_SPIN_CYCLES = 20_000_000  # about 10 ms of one SM: longer than any call's enqueue


class ChunkTiming(msgspec.Struct, frozen=True, kw_only=True):
    """One contender at one thread count: medians per call in microseconds (``device_us``,
    ``busy_us``: one thread only, None where the device has no timing events / no spin
    kernel), aggregate calls/s and GB/s of all its threads."""

    host_us: float
    done_us: float
    device_us: float | None
    busy_us: float | None
    calls_per_s: float
    gbps: float


class TransferRow(msgspec.Struct, frozen=True, kw_only=True):
    """One layout x direction: ``timings`` keyed ``<contender>@<threads>``, ``ratios`` of
    them from the same run (None where a side is absent), ``exact`` whether kvactors and
    the bare route moved the same bytes (None: not checked), ``error`` why the case failed."""

    device: str
    simulated: bool
    pinned: bool
    model: str
    layout: str
    direction: str
    nbytes: int
    blocks: int
    calls: int
    exact: bool | None
    timings: dict[str, ChunkTiming]
    ratios: dict[str, float | None]
    error: str = ""


class _Dev:
    """The device's streams, timing events and spin kernel (none of them on CPU)."""

    def __init__(self, env: DeviceEnv) -> None:
        self.env = env
        self.backend = env.backend()
        self.mod: Any = None if env.kind == "cpu" else getattr(torch, env.kind)
        self.spin: Callable[[int], None] | None = getattr(self.mod, "_sleep", None)
        if env.fake is not None:
            self.spin = None

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.env.kind == "cpu" or self.env.fake is not None:
            return self.env.zeros(shape, torch.bfloat16)
        return torch.zeros(shape, dtype=torch.bfloat16, device=torch.device(self.env.kind, 0))

    def stream(self) -> Any:
        return None if self.mod is None else self.mod.Stream()

    def context(self, s: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return contextlib.nullcontext if s is None else (lambda: self.mod.stream(s))

    def event(self) -> Any:
        return None if self.mod is None else self.mod.Event(enable_timing=True)


class _Samples:
    """One lane's per-call seconds: until return, until done."""

    def __init__(self) -> None:
        self.host: list[float] = []
        self.done: list[float] = []

    def clear(self) -> None:
        for xs in (self.host, self.done):
            xs.clear()


class _Caller:
    """Caller ``c``'s stream, chunk, block-id sets (host tuples and device tensors), a device
    buffer of the chunk's bytes and a staging buffer for the bare route."""

    def __init__(self, dev: _Dev, pool: Pool, c: int, sets: Sequence[tuple[int, ...]]) -> None:
        self.stream = dev.stream()
        self.chunk = pool.objects[c]
        self.sets = list(sets)
        self.dev_ids = [dev.env.to_device(torch.tensor(s, dtype=torch.int64)) for s in sets]
        self.flat = dev.zeros((self.chunk.numel(),))
        self.staging = dev.zeros(tuple(self.chunk.shape)) if pool.stack is not None else None
        self.sync: Callable[[], object] = (
            (lambda: None) if self.stream is None else self.stream.synchronize
        )


def _contenders(
    rt: Runtime, dev: _Dev, pool: Pool, k: _Caller, gather: bool, lmcache: Any
) -> dict[str, Callable[[], object]]:
    """Caller ``k``'s one call per contender, each cycling over its block-id sets."""
    chunk, flat, st = k.chunk, k.flat.view(-1), k.staging
    cf = chunk.view(-1)
    fns: dict[str, Callable[[], object]] = {
        "raw": (lambda: cf.copy_(flat, non_blocking=True))
        if gather
        else (lambda: flat.copy_(cf, non_blocking=True))
    }
    if pool.stack is not None and st is not None:
        stack, dim, view, ids = pool.stack, pool.block_dim, pool.chunk_view(st), k.dev_ids
        ring = itertools.cycle(range(len(ids)))

        def bare_gather() -> None:
            torch.index_select(stack, dim, ids[next(ring)], out=view)
            chunk.copy_(st, non_blocking=True)

        def bare_scatter() -> None:
            st.copy_(chunk, non_blocking=True)
            stack.index_copy_(dim, ids[next(ring)], view)

        fns["bare"] = bare_gather if gather else bare_scatter
    handle = 0 if k.stream is None else dev.backend.stream_handle(k.stream)
    reqs = [pool.request(1 if gather else 0, s) for s in k.sets]
    paged, objs = pool.paged, (chunk,)

    def kvactors(complete: bool) -> Callable[[], object]:
        ring = itertools.cycle(reqs)
        return lambda: rt.transfer(next(ring), paged, objs, stream_handle=handle, complete=complete)

    fns["kvactors"], fns["kvactors_async"] = kvactors(True), kvactors(False)
    if lmcache is not None:
        fns["lmcache"] = lmcache(reqs[0], paged, [chunk])
    return fns


def _timed(fn: Callable[[], object], k: _Caller, out: _Samples) -> Callable[[], None]:
    """``fn`` followed by its stream's synchronize, its times recorded in ``out`` (no event
    is recorded in a timed window: on a fake stream an event is work of its own)."""
    perf, sync = time.perf_counter, k.sync

    def call() -> None:
        t0 = perf()
        fn()
        t1 = perf()
        sync()
        t2 = perf()
        out.host.append(t1 - t0)
        out.done.append(t2 - t0)

    return call


def _span(fn: Callable[[], object], k: _Caller, dev: _Dev, n: int) -> float | None:
    """Median device ms between events recorded before and after ``fn`` (one caller)."""
    e0, e1 = dev.event(), dev.event()
    if e0 is None or e1 is None:
        return None
    got = []
    with dev.context(k.stream)():
        for _ in range(n):
            e0.record()
            fn()
            e1.record()
            k.sync()
            got.append(e0.elapsed_time(e1))
    return float(statistics.median(got))


def _busy(fn: Callable[[], object], k: _Caller, dev: _Dev, n: int) -> float | None:
    """Median device ms of ``fn``'s work with the stream held by a spin kernel meanwhile."""
    spin = dev.spin
    if spin is None or k.stream is None:
        return None
    e0, e1, got = dev.event(), dev.event(), []
    with dev.context(k.stream)():
        for _ in range(n):
            spin(_SPIN_CYCLES)
            e0.record()
            fn()
            e1.record()
            k.sync()
            got.append(e0.elapsed_time(e1))
    return float(statistics.median(got))


def _exact(fns: dict[str, Callable[[], object]], k: _Caller) -> bool:
    """Random bytes scattered by one route come back through the other: kvactors then bare,
    bare then kvactors (kvactors both ways without a bare route). Each route's next call
    takes its first block-id set, so both calls of a pair meet the same blocks."""
    chunk = k.chunk
    sent = torch.randn(tuple(chunk.shape)).to(chunk.dtype)
    pairs = (
        (("kvactors", "bare"), ("bare", "kvactors"))
        if "bare:gather" in fns
        else (("kvactors", "kvactors"),)
    )
    ok = True
    for put, get in pairs:
        chunk.copy_(sent)
        fns[f"{put}:scatter"]()
        k.sync()
        chunk.zero_()
        fns[f"{get}:gather"]()
        k.sync()
        ok = ok and torch.equal(chunk, sent)
    return ok


def _case(
    rt: Runtime,
    dev: _Dev,
    pool: Pool,
    callers: list[_Caller],
    gather: bool,
    calls: int,
    rounds: int,
    lmcache: Any,
) -> tuple[bool, dict[str, ChunkTiming]]:
    """One direction of one layout: the check, then every contender at 1 and 4 threads."""
    one = callers[0]  # the one caller cycles over every caller's sets
    with dev.context(one.stream)():
        check = {
            f"{n}:{d}": fn
            for d in ("gather", "scatter")
            for n, fn in _contenders(rt, dev, pool, one, d == "gather", None).items()
        }
        exact = _exact(check, one)
    lanes: dict[tuple[str, int], list[Lane]] = {}
    samples: dict[tuple[str, int], list[_Samples]] = {}
    plain: dict[str, Callable[[], object]] = {}
    for threads in THREADS:
        for k in [one] if threads == 1 else callers[1 : threads + 1]:
            fns = _contenders(rt, dev, pool, k, gather, lmcache)
            if threads == 1:
                plain = fns
            for name, fn in fns.items():
                s = _Samples()
                samples.setdefault((name, threads), []).append(s)
                lane = Lane([("call", _timed(fn, k, s))], context=dev.context(k.stream))
                lanes.setdefault((name, threads), []).append(lane)

    def warmed() -> None:
        for ss in samples.values():
            for s in ss:
                s.clear()

    got = rates(lanes, calls, rounds, warmed=warmed)
    spun = ("raw", "bare", "kvactors_async")
    busy: dict[str, float | None] = {n: _busy(plain[n], one, dev, 8) for n in spun if n in plain}
    spans = {n: _span(fn, one, dev, 8) for n, fn in plain.items()}
    nbytes = callers[0].chunk.nbytes
    out: dict[str, ChunkTiming] = {}

    def med(xs: list[float], scale: float) -> float:
        return float(statistics.median(xs)) * scale

    for (name, threads), t in got.items():
        ss = samples[name, threads]

        span = spans.get(name) if threads == 1 else None
        b = busy.get(name) if threads == 1 else None
        out[f"{name}@{threads}"] = ChunkTiming(
            host_us=med([x for s in ss for x in s.host], 1e6),
            done_us=med([x for s in ss for x in s.done], 1e6),
            device_us=None if span is None else span * 1e3,
            busy_us=None if b is None else b * 1e3,
            calls_per_s=t.calls_per_s,
            gbps=t.calls_per_s * nbytes / 1e9,
        )
    return exact, out


def _ratios(t: dict[str, ChunkTiming]) -> dict[str, float | None]:
    """kvactors over raw and bare (GB/s) at 1 and 4 threads, 4 threads over 1 per contender,
    time until done over the device's busy time."""

    def r(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def g(key: str) -> float | None:
        return t[key].gbps if key in t else None

    out = {
        f"kvactors/{o}@{n}": r(g(f"kvactors@{n}"), g(f"{o}@{n}"))
        for o in ("raw", "bare", "lmcache")
        for n in THREADS
    }
    out["kvactors_async/bare@1"] = r(g("kvactors_async@1"), g("bare@1"))
    for c in ("raw", "bare", "kvactors", "kvactors_async"):
        out[f"{c} 4/1"] = r(g(f"{c}@4"), g(f"{c}@1"))
    busy: dict[str, float | None] = {
        c: t[f"{c}@1"].busy_us for c in ("kvactors_async", "bare") if f"{c}@1" in t
    }
    out["kvactors done/busy"] = r(t["kvactors@1"].done_us, busy.get("kvactors_async"))
    out["bare done/busy"] = r(t["bare@1"].done_us, busy.get("bare")) if "bare@1" in t else None
    return out


def block_sets(blocks: int, per_set: int, callers: int) -> list[tuple[int, ...]]:
    """The pool's blocks shuffled once (seeded) and cut into sets of ``per_set``, as many as
    ``callers`` can share evenly: no block is in two sets, so caller ``c`` of ``callers``,
    cycling over ``sets[c::callers]``, meets no block twice in a cycle, nor another's."""
    order = random.Random(0).sample(range(blocks), blocks)
    sets = [tuple(order[i : i + per_set]) for i in range(0, blocks - per_set + 1, per_set)]
    return sets[: len(sets) - len(sets) % callers]


def run_transfer(
    env: DeviceEnv,
    layouts: Sequence[str],
    *,
    reps: int = 30,
    rounds: int = 5,
    blocks: int = 4096,
    model: str = "8b",
    progress: Callable[[str], None] | None = None,
) -> list[TransferRow]:
    """Measure both directions of each layout on ``env``'s device (see the module docstring):
    ``reps`` calls per thread and window, ``rounds`` windows, a pool of ``blocks`` blocks of
    ``model`` (one of :data:`~kvactors.cli.bench._pools.MODELS`). A case that raises becomes
    a row with its ``error``; the others still run."""
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    dev = _Dev(env)
    make_lmcache = baseline("lmcache_torch") if env.kind == "cpu" else None
    rows: list[TransferRow] = []
    with Runtime(dev.backend, default_timeout=120.0) as rt:
        for layout in layouts:
            n = max(THREADS)
            pool = Pool(model, layout, blocks, n + 1, zeros=dev.zeros, pin=True)
            sets = block_sets(blocks, pool.bpo, n)
            # Caller 0 alone cycles over every set; callers 1-4 at once over a quarter each.
            callers = [_Caller(dev, pool, 0, sets)]
            callers += [_Caller(dev, pool, c + 1, sets[c::n]) for c in range(n)]
            for d in ("gather", "scatter"):
                row = TransferRow(
                    device=env.kind,
                    simulated=env.simulated,
                    pinned=_pinned(pool.objects[0]),
                    model=model,
                    layout=layout,
                    direction=d,
                    nbytes=pool.objects[0].nbytes,
                    blocks=blocks,
                    calls=reps,
                    exact=None,
                    timings={},
                    ratios={},
                )
                try:
                    try:
                        got = _case(
                            rt, dev, pool, callers, d == "gather", reps, rounds, make_lmcache
                        )
                    except ImportError:  # the adapter is installed but lmcache is not
                        make_lmcache = None
                        got = _case(rt, dev, pool, callers, d == "gather", reps, rounds, None)
                    row = msgspec.structs.replace(
                        row, exact=got[0], timings=got[1], ratios=_ratios(got[1])
                    )
                except Exception as exc:  # the other cases still run
                    row = msgspec.structs.replace(row, error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
                if progress is not None:
                    progress(f"transfer {layout} {d}{' (not measured)' if row.error else ''}")
            del pool, callers
    return rows


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # CPU-only torch
        return False


def format_transfer(rows: Sequence[TransferRow]) -> str:
    """The rows as a text table (GB/s at 1 thread, kvactors' ratios, its times per call: until
    return, async until return, until done, device span, device busy), then failed cases."""
    sim = " (SIMULATED: compare contenders, not GB/s)" if any(r.simulated for r in rows) else ""

    def f(x: float | None) -> object:
        return "n/a" if x is None else x

    # fmt: off
    def cells(r: TransferRow) -> tuple[object, ...]:
        t, q = r.timings, r.ratios
        k = t["kvactors@1"]
        busy = t["kvactors_async@1"].busy_us
        return (
            r.layout, r.direction, round(r.nbytes / 2**20, 1), t["raw@1"].gbps,
            f(t["bare@1"].gbps if "bare@1" in t else None), k.gbps,
            f(t["lmcache@1"].gbps if "lmcache@1" in t else None), f(q.get("kvactors/raw@1")),
            f(q.get("kvactors/bare@1")), f(q.get("kvactors/raw@4")),
            f(q.get("kvactors 4/1")), k.host_us, t["kvactors_async@1"].host_us, k.done_us,
            f(k.device_us), f(busy), f(q.get("kvactors done/busy")), "yes" if r.exact else "NO",
        )

    head = ("layout", "dir", "MiB", "raw", "bare", "kva", "lmc", "kva/raw", "kva/bare", "kva/raw 4",
            "kva 4/1", "ret us", "async us", "done us", "dev us", "busy us", "done/busy", "exact")
    # fmt: on
    dev = rows[0].device if rows else ""
    text = table(
        f"one-chunk calls on {dev}, GB/s at 1 thread (4: four threads){sim}",
        head,
        (cells(r) for r in rows if not r.error),
    )
    failed = [f"{r.layout} {r.direction} not measured: {r.error}" for r in rows if r.error]
    return "\n".join([text, *failed] if text else failed)
