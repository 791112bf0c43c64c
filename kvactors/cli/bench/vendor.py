"""kvactors' op against LMCache's own ``MluDeviceOps`` / ``MusaDeviceOps`` on the fake vendors.

Per layout LMCache serves there, both ops move the same blocks with LMCache's argument types
(8 layers in one allocation, 2 chunks of 4 blocks, bf16, other ids every call), returning once
the copies are enqueued on the caller's stream: the engine's pattern (three store threads and
one retrieving thread, each on its own stream: ``4``), one thread making that mix (``1``), and
that thread with each transfer followed by a completion record on its stream and a drain, as
LMCache's server-driven path records one (``ld``). One vendor per interpreter
(``python -m kvactors.cli.bench.vendor mlu``).
"""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.cli.bench._harness import Lane, baseline, rates, table
from kvactors.cli.bench._pools import Pool
from kvactors.errors import BackendUnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.testing import FakeVendor

__all__ = ("VENDOR_LAYOUTS", "VendorRow", "format_vendor", "measure_vendor", "pool", "run_vendor")

_PATTERNS = ("1", "4", "ld")

VENDOR_LAYOUTS = {"mlu": ("nhd", "hnd", "mla"), "musa": ("nhd", "mla", "kv_list")}
"""Layouts LMCache's own backend serves, per vendor."""


class VendorRow(msgspec.Struct, frozen=True, kw_only=True):
    """One vendor x layout x direction x contender: median host time per call until it
    returned and the pattern's aggregate calls/s (both directions), keyed by pattern."""

    vendor: str
    layout: str
    direction: str
    contender: str
    host_us: dict[str, float]
    calls_per_s: dict[str, float]


def pool(fake: FakeVendor, layout: str) -> Pool:
    """The operands of ``layout`` on ``fake``'s device (host chunks pinned)."""
    return Pool(
        "small", layout, 64, 2, zeros=lambda s: fake.empty(s, torch.bfloat16), tokens=64, pin=True
    )


def _patterns(
    makers: dict[str, Any], p: Pool, dev: Any, sets: list[Any], mod: Any
) -> dict[tuple[str, str], list[Lane]]:
    """Per contender: ``1`` one thread making the engine's mix, ``4`` the engine's threads,
    ``ld`` the mix with a record after each transfer; every thread on its own stream, its
    windows ending with that stream synchronized."""

    def lane(calls: list[tuple[str, Callable[[], object]]]) -> Lane:
        s = mod.Stream()
        return Lane(calls, context=lambda: mod.stream(s), done=s.synchronize)

    out: dict[tuple[str, str], list[Lane]] = {}
    for name, make in makers.items():
        for record in (False, True):
            calls = [
                (
                    tag,
                    make(p.request(d, sets[k]), p.paged, p.objects, dev, sets[k::4], record=record),
                )
                for k, (tag, d) in enumerate((("store", 1),) * 3 + (("retrieve", 0),))
            ]
            if record:
                out[name, "ld"] = [lane(calls)]
            else:
                out[name, "1"], out[name, "4"] = [lane(calls)], [lane([c]) for c in calls]
    return out


def measure_vendor(kind: str, *, calls: int = 30, rounds: int = 3) -> list[VendorRow]:
    """Measure every layout of ``kind`` in this process (see the module docstring); the fake
    must own torch's device name here, and LMCache must have the vendor's ops."""
    from kvactors.cli._devenv import DeviceEnv
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor

    theirs, ours = baseline(f"lmcache_{kind}_ops"), baseline("kvactors_vendor_op")
    if theirs is None or ours is None:
        raise BackendUnavailableError(backend=kind, reason="needs LMCache (its own vendor ops)")
    torch.set_num_threads(1)
    rows: list[VendorRow] = []
    with fake_vendor(kind) as fake:
        if not fake.torch_devices:
            reason = f"torch's device name is taken; set KVACTORS_FAKE_VENDOR={kind}"
            raise BackendUnavailableError(backend=kind, reason=reason)
        backend = DeviceEnv(kind, fake, "").backend()  # MLU: NHD memory, format 1 resolved
        dev = torch.device(kind, 0)
        with Runtime(backend, default_timeout=120.0) as rt:
            for layout in VENDOR_LAYOUTS[kind]:
                p = pool(fake, layout)
                rng = random.Random(0)
                sets = [tuple(rng.sample(range(64), 8)) for _ in range(64)]  # two chunks a call

                makers: dict[str, Any] = {
                    "kvactors": functools.partial(ours, rt),
                    "lmcache": theirs,
                }
                makers["lmcache"](p.request(1, sets[0]), p.paged, p.objects, dev)  # ops here?
                got = rates(_patterns(makers, p, dev, sets, getattr(torch, kind)), calls, rounds)
                for name in makers:
                    for d, tag in (("gather", "store"), ("scatter", "retrieve")):
                        host = {n: got[name, n].p50_us[tag] for n in _PATTERNS}
                        cps = {n: got[name, n].calls_per_s for n in _PATTERNS}
                        key = {"vendor": kind, "layout": layout, "direction": d}
                        row = {**key, "contender": name, "host_us": host, "calls_per_s": cps}
                        rows.append(msgspec.convert(row, VendorRow))
    return rows


def run_vendor(calls: int, rounds: int, python: str | None) -> tuple[list[VendorRow], list[str]]:
    """:func:`measure_vendor` for each vendor in its own interpreter (``python``, default
    this one): the rows, and why a vendor was left out (e.g. its LMCache lacks the ops)."""
    rows: list[VendorRow] = []
    skipped: list[str] = []
    for kind in VENDOR_LAYOUTS:
        env = {**os.environ, "KVACTORS_FAKE_VENDOR": kind, "LMCACHE_TRACK_USAGE": "false"}
        cmd = [python or sys.executable, "-m", "kvactors.cli.bench.vendor", kind]
        cmd += [str(calls), str(rounds)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
        if proc.returncode == 3:
            skipped.append(f"{kind}: {proc.stderr.strip().splitlines()[-1]}")
        elif proc.returncode != 0 or not lines:
            reason = f"vendor bench failed ({proc.returncode}): {proc.stderr[-2000:]}"
            raise BackendUnavailableError(backend=kind, reason=reason)
        else:
            rows += msgspec.json.decode(lines[-1], type=list[VendorRow])
    return rows, skipped


def format_vendor(rows: Sequence[VendorRow]) -> str:
    """Host us per call (1 thread / the engine's 4) of both contenders, kvactors' over
    LMCache's (also with a record after each transfer: ``ld``), and kvactors' aggregate
    calls/s with 4 threads over 1."""
    by: dict[tuple[str, str, str], dict[str, VendorRow]] = {}
    for r in rows:
        by.setdefault((r.vendor, r.layout, r.direction), {})[r.contender] = r
    g = [(k, c["kvactors"], c["lmcache"].host_us) for k, c in by.items() if "kvactors" in c]
    head = (
        "vendor",
        "layout",
        "dir",
        "kva 1",
        "kva 4",
        "lmc 1",
        "lmc 4",
        "kva/lmc 1",
        "4",
        "ld",
        "kva 4/1",
    )
    return table(
        "fake vendors: host us per call until it returned (1 thread / the engine's 4)",
        head,
        ((*k, r.host_us["1"], r.host_us["4"], m["1"], m["4"], r.host_us["1"] / m["1"],
          r.host_us["4"] / m["4"], r.host_us["ld"] / m["ld"],
          r.calls_per_s["4"] / r.calls_per_s["1"]) for k, r, m in g),
    )  # fmt: skip


if __name__ == "__main__":  # python -m kvactors.cli.bench.vendor KIND [CALLS [ROUNDS]]
    argv = [*sys.argv[1:], "30", "3"]
    try:
        found = measure_vendor(argv[0], calls=int(argv[1]), rounds=int(argv[2]))
    except (BackendUnavailableError, ImportError) as exc:
        print(f"left out: {exc}", file=sys.stderr)
        sys.exit(3)
    print(msgspec.json.encode(found).decode())
