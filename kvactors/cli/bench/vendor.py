"""kvactors next to LMCache's own MLU and MUSA backends, on the fake vendors.

Per vendor, layout and direction, ``kvactors`` (the plugin's op, entry point
``kvactors_vendor_op``; without LMCache ``Runtime.transfer(..., complete=False)``) and
``lmcache`` (``MluDeviceOps`` / ``MusaDeviceOps``, entry points ``lmcache_mlu_ops`` /
``lmcache_musa_ops``) move the same blocks, other block ids on every call. Reported: device
operations per call in steady state (``OpCounts``), host time until return and until
complete, and :func:`budget_violations`. Fake host times compare contenders, not cards. Each
vendor runs in its own interpreter (``--kind mlu``); :func:`run_vendor_bench` gathers them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.errors import BackendUnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.testing import FakeVendor

__all__ = (
    "BACKGROUND_SYNCS",
    "VENDOR_LAYOUTS",
    "VendorRow",
    "budget_violations",
    "format_vendor_table",
    "measure_vendor",
    "run_vendor_bench",
)

#: Layouts LMCache's own backend serves, per vendor (lmcache-057.md sections 1 and 3).
VENDOR_LAYOUTS: dict[str, tuple[str, ...]] = {
    "mlu": ("NHD", "HND", "MLA"),
    "musa": ("NHD", "MLA", "KV lists"),
}
_FORMATS = {"NHD": 1, "HND": 6, "MLA": 3, "KV lists": 9}


@dataclasses.dataclass(frozen=True)
class VendorRow:
    """One (vendor, layout, direction, contender) measurement."""

    vendor: str
    layout: str
    direction: str  # "gather" (D2H, store) or "scatter" (H2D, retrieve)
    contender: str  # "kvactors" or "lmcache"
    chunks: int
    planes: int
    counts: dict[str, int] | None  # per call, steady state; None: contender absent
    host_us: float | None  # median host time until the call returned
    complete_us: float | None  # median host time until its work completed
    note: str = ""
    violations: tuple[str, ...] = ()


#: Host syncs per kvactors call that are not on the caller's path: the one event wait with
#: which the runtime learns that the device finished a launch (the lane's reaper thread, or
#: the lane itself when the work is already complete), so it can drop the operands then
#: (rule 3) and answer fences (rule 4). It never delays the call's return; the bench counts
#: it (the window ends when a fence answered) and the budget check sets it apart.
BACKGROUND_SYNCS = 1


def budget_violations(
    counts: dict[str, int],
    *,
    chunks: int,
    planes: int,
    gather: bool,
    contiguous: bool,
    background_syncs: int = 0,
) -> list[str]:
    """Where one call's device operations exceed kvactors' per-call budget (issue 11.6).

    At most one gather/scatter launch per chunk and K/V plane (device-to-device copies count
    as launches) plus one host<->device copy per chunk; at most one host synchronisation per
    call, none for a D2H into contiguous chunks (the caller synchronises before it reads);
    no device allocation in steady state. ``background_syncs`` of the counted syncs happened
    off the caller's path (:data:`BACKGROUND_SYNCS`) and are not held against the call.
    """
    out: list[str] = []
    if counts["launches"] > chunks * planes:
        out.append(f"launches {counts['launches']} > {chunks * planes} (chunks x planes)")
    if counts["h2d"] + counts["d2h"] > chunks:
        out.append(f"host<->device copies {counts['h2d'] + counts['d2h']} > {chunks} (chunks)")
    sync_limit = 0 if (gather and contiguous) else 1
    syncs = counts["syncs"] - background_syncs
    if syncs > sync_limit:
        out.append(f"host syncs on the call's path {syncs} > {sync_limit}")
    if counts["allocations"] > 0:
        out.append(f"device allocations {counts['allocations']} > 0")
    return out


_ID_SETS = 64  # other block ids on every call: the contenders cycle through these sets


@dataclasses.dataclass(frozen=True)
class _Shape:
    nl: int = 8
    nb: int = 64
    bs: int = 16
    nh: int = 4
    hs: int = 64
    mla_hs: int = 288
    chunk_blocks: int = 4
    chunks: int = 2
    dtype: str = "bfloat16"


def _operands(
    fake: FakeVendor, layout: str, shape: _Shape, seed: int
) -> tuple[Any, list[torch.Tensor], Any]:
    """(device paged operand, host chunks, kvactors ShapeDesc) for one layout."""
    from kvactors.core.layouts import ShapeDesc

    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator().manual_seed(seed)
    mla = layout == "MLA"
    nh, hs = (1, shape.mla_hs) if mla else (shape.nh, shape.hs)
    unit = {
        "NHD": (2, shape.nb, shape.bs, nh, hs),
        "HND": (2, shape.nb, nh, shape.bs, hs),
        "MLA": (shape.nb, shape.bs, hs),
        "KV lists": (shape.nb, shape.bs, nh, hs),
    }[layout]

    # One allocation holding every layer (per-layer views), as vLLM's allocator does.
    planes = 2 if layout == "KV lists" else 1
    pool = fake.to_device(torch.randn((planes * shape.nl, *unit), generator=gen).to(dtype))
    units = list(pool.unbind(0))
    tokens = shape.chunk_blocks * shape.bs
    if layout == "KV lists":
        paged: Any = [units[: shape.nl], units[shape.nl :]]
    else:
        paged = units
    oshape = (shape.nl, tokens, hs) if mla else (2, shape.nl, tokens, nh * hs)
    objects = [torch.zeros(oshape, dtype=dtype).pin_memory() for _ in range(shape.chunks)]
    desc = ShapeDesc(
        kv_size=1 if mla else 2,
        nl=shape.nl,
        nb=shape.nb,
        bs=shape.bs,
        nh=nh,
        hs=hs,
        element_size=torch.empty(0, dtype=dtype).element_size(),
        dtype=shape.dtype,
    )
    return paged, objects, desc


def _baseline(name: str) -> Callable[..., Callable[[], None]] | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="kvactors.baselines"):
        if ep.name == name:
            try:
                return ep.load()  # type: ignore[no-any-return]
            except ImportError:
                return None
    return None


def _time(
    fns: dict[str, Callable[[], None]], sync: Callable[[], None], reps: int
) -> dict[str, tuple[float, float]]:
    ret: dict[str, list[float]] = {k: [] for k in fns}
    done: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():  # interleaved, so drift hits both alike
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            ret[name].append(t1 - t0)
            done[name].append(t2 - t0)
    return {k: (statistics.median(ret[k]) * 1e6, statistics.median(done[k]) * 1e6) for k in fns}


def measure_vendor(
    kind: str, *, reps: int = 30, seed: int = 0, lmcache: bool = True
) -> list[VendorRow]:
    """Measure every layout and direction of ``kind`` in this process (see module doc).

    Args:
        kind: ``"mlu"`` or ``"musa"``.
        reps: timed repetitions per contender (0: counts only).
        seed: operand and fake seed.
        lmcache: also measure LMCache's own ops (needs the fake's real torch devices).

    Raises:
        RuntimeError: LMCache's ops were asked for but this process's torch device name
            belongs to the other vendor.
    """
    from kvactors.core.layouts import Direction
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor

    torch.set_num_threads(1)
    shape = _Shape()
    make_lmcache = _baseline(f"lmcache_{kind}_ops") if lmcache else None
    make_ours = _baseline("kvactors_vendor_op") if lmcache else None
    rows: list[VendorRow] = []
    with fake_vendor(kind, seed=seed) as fake:
        if lmcache and not fake.torch_devices:
            raise BackendUnavailableError(
                backend=kind,
                reason=f"torch's device name is taken in this process; run {kind} in its own "
                f"interpreter (KVACTORS_FAKE_VENDOR={kind})",
            )
        mod = getattr(torch, kind)
        # The operands are real NHD memory: on MLU, format 1 is declared resolved.
        if kind == "mlu":
            from kvactors.devices.mlu import MluBackend

            backend = Runtime(MluBackend(layout_source="resolved"), default_timeout=120.0)
        else:
            backend = Runtime(kind, device_index=0, default_timeout=120.0)
        with backend as rt:
            for layout in VENDOR_LAYOUTS[kind]:
                paged, objects, desc = _operands(fake, layout, shape, seed)
                n_ids = shape.chunk_blocks * shape.chunks
                rng = random.Random(seed)
                id_sets = [tuple(rng.sample(range(shape.nb), n_ids)) for _ in range(_ID_SETS)]
                ids = id_sets[0]
                every = tuple(range(shape.nb))
                planes = 1 if layout == "MLA" else 2
                for dname, direction in (("gather", Direction.D2H), ("scatter", Direction.H2D)):
                    req = TransferRequest(
                        fmt=_FORMATS[layout],
                        direction=int(direction),
                        block_ids=ids,
                        chunk_size=shape.chunk_blocks * shape.bs,
                        shape=desc,
                    )

                    def ours(
                        sets: list[tuple[int, ...]],
                        req: TransferRequest = req,
                        paged: Any = paged,
                        objects: list[torch.Tensor] = objects,
                    ) -> Callable[[], None]:
                        ring = itertools.cycle(sets)

                        def call() -> None:
                            # As the kvactors_mlu/_musa LMCache op calls it: enqueue-return;
                            # the caller synchronizes before it reads chunks (not counted).
                            handle = rt.backend.current_stream_handle(0)
                            r = msgspec.structs.replace(req, block_ids=next(ring))
                            rt.transfer(r, paged, objects, stream_handle=handle, complete=False)

                        return call

                    # torch parses the device name only where the fake owns it (with LMCache).
                    measured = make_ours is not None or make_lmcache is not None
                    dev: Any = torch.device(kind, 0) if measured else None

                    note = ""
                    if not lmcache:
                        note = "not measured"
                    elif make_lmcache is None:
                        note = f"lmcache (or its {kind} ops) not importable"

                    def contenders(
                        sets: list[tuple[int, ...]],
                        req: TransferRequest = req,
                        paged: Any = paged,
                        objects: list[torch.Tensor] = objects,
                        dev: Any = dev,
                        note: str = note,
                    ) -> tuple[dict[str, Callable[[], None]], str]:
                        try:
                            mine = (
                                None
                                if make_ours is None
                                else make_ours(rt, req, paged, objects, dev, sets)
                            )
                        except ImportError as exc:  # the plugin's op needs LMCache
                            mine, note = None, f"kvactors through the runtime (op: {exc})"
                        out = {"kvactors": ours(sets) if mine is None else mine}
                        if make_lmcache is None:
                            return out, note
                        try:
                            out["lmcache"] = make_lmcache(req, paged, objects, dev, sets)
                        except (ImportError, NotImplementedError) as exc:
                            return out, f"lmcache: {exc}"
                        return out, note

                    # Counted in steady state (the ids of the warm-up calls); timed with other
                    # block ids on every call.
                    steady, note = contenders([ids])
                    fns, note = contenders(id_sets)
                    for fn in [*steady.values(), *fns.values()]:  # warm up: plans, caches
                        fn()
                        fn()
                        mod.synchronize()
                    counts: dict[str, dict[str, int]] = {}
                    for name, fn in steady.items():
                        rt.fence(every)  # the runtime idle: nothing of the warm-up counted
                        with fake.counting() as ops:
                            fn()
                            if name == "kvactors":
                                # Until its reaper saw the device finish (one event wait per
                                # call, off the caller's thread; counted as BACKGROUND_SYNCS).
                                rt.fence(every)
                        mod.synchronize()
                        counts[name] = ops.counts.as_dict()
                    times = (
                        _time(fns, mod.synchronize, reps)
                        if reps > 0
                        else {k: (float("nan"), float("nan")) for k in fns}
                    )
                    for name in ("kvactors", "lmcache"):
                        if name not in fns:
                            rows.append(
                                VendorRow(
                                    kind,
                                    layout,
                                    dname,
                                    name,
                                    shape.chunks,
                                    planes,
                                    None,
                                    None,
                                    None,
                                    note,
                                )
                            )
                            continue
                        viol: tuple[str, ...] = ()
                        if name == "kvactors":
                            viol = tuple(
                                budget_violations(
                                    counts[name],
                                    chunks=shape.chunks,
                                    planes=planes,
                                    gather=dname == "gather",
                                    contiguous=True,
                                    background_syncs=BACKGROUND_SYNCS,
                                )
                            )
                        rows.append(
                            VendorRow(
                                kind,
                                layout,
                                dname,
                                name,
                                shape.chunks,
                                planes,
                                counts[name],
                                times[name][0],
                                times[name][1],
                                "",
                                viol,
                            )
                        )
    return rows


def run_vendor_bench(
    kinds: Sequence[str] = ("mlu", "musa"), *, reps: int = 30, timeout: float = 600.0
) -> list[VendorRow]:
    """Run :func:`measure_vendor` for each kind in its own interpreter; gather the rows."""
    rows: list[VendorRow] = []
    for kind in kinds:
        env = {
            **os.environ,
            "KVACTORS_FAKE_VENDOR": kind,
            "OMP_NUM_THREADS": "1",
            "LMCACHE_TRACK_USAGE": "false",
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvactors.cli.bench.vendor",
                "--kind",
                kind,
                "--reps",
                str(reps),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
        if proc.returncode != 0 or not lines:
            raise BackendUnavailableError(
                backend=kind,
                reason=f"vendor bench failed ({proc.returncode}): {proc.stderr[-2000:]}",
            )
        for d in json.loads(lines[-1]):
            d["violations"] = tuple(d["violations"])
            rows.append(VendorRow(**d))
    return rows


def _fmt_counts(c: dict[str, int] | None) -> str:
    if c is None:
        return "-"
    return f"{c['launches']}L {c['h2d']}/{c['d2h']}/{c['d2d']} {c['syncs']}S {c['allocations']}A"


def format_vendor_table(rows: Sequence[VendorRow]) -> str:
    """A plain-text side-by-side table (kvactors | LMCache's own backend)."""
    head = (
        f"{'vendor':6} {'layout':9} {'dir':8} | {'kvactors ops':18} {'ret us':>8} "
        f"{'done us':>8} | {'lmcache ops':18} {'ret us':>8} {'done us':>8} | {'ret/lmc':>7} | "
        "budget"
    )
    lines = [head, "-" * len(head)]
    by = {(r.vendor, r.layout, r.direction, r.contender): r for r in rows}
    seen: list[tuple[str, str, str]] = []
    for r in rows:
        key = (r.vendor, r.layout, r.direction)
        if key not in seen:
            seen.append(key)
    for key in seen:
        k, lm = by.get((*key, "kvactors")), by.get((*key, "lmcache"))

        def cell(r: VendorRow | None) -> str:
            if r is None or r.counts is None:
                return f"{'-':18} {'-':>8} {'-':>8}"
            return f"{_fmt_counts(r.counts):18} {r.host_us or 0:8.0f} {r.complete_us or 0:8.0f}"

        budget = (
            "ok"
            if k is not None and not k.violations
            else "; ".join(k.violations if k is not None else ("-",))
        )
        ratio = (
            f"{k.host_us / lm.host_us:7.2f}"
            if k is not None and lm is not None and k.host_us and lm.host_us
            else f"{'-':>7}"
        )
        lines.append(
            f"{key[0]:6} {key[1]:9} {key[2]:8} | {cell(k)} | {cell(lm)} | {ratio} | {budget}"
        )
    lines.append(
        "ops: <L>aunches <h2d>/<d2h>/<d2d> copies <S>yncs <A>llocations, per call; "
        "ret: host time to return, done: to completion (fake devices); ret/lmc: kvactors' "
        "return time over LMCache's"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvactors.cli.bench.vendor --kind mlu|musa``: one vendor, JSON rows on stdout."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvactors.cli.bench.vendor")
    ap.add_argument("--kind", choices=sorted(VENDOR_LAYOUTS), required=True)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    rows = measure_vendor(args.kind, reps=args.reps)
    print(json.dumps([dataclasses.asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
