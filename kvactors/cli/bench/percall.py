"""Per-call benchmark: what one transfer call costs against the single torch call of the same bytes.

On an accelerator the copy is asynchronous, so the host time of a call bounds throughput. Per
case (model, layout, direction, one chunk of 256 bf16 tokens) the contenders run call by call,
order rotated every repetition: ``torch`` (one ``index_select`` / ``index_copy_``),
``runtime`` (``Runtime.transfer``), ``op`` (LMCache's op of ``kvactors_cpu``) and ``lmcache``
(LMCache's torch path; both through ``kvactors.baselines`` entry points). Small-model single
callers also run with other block ids on every call (``ids=fresh``) and with other chunk
buffers too (``ids=bufs``); ``callers=4`` runs every contender in 4 threads at once.
Run ``python -m kvactors.cli.bench.percall --help`` (``kvactors bench`` runs it too).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import statistics
import threading
import time
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.core.layouts import FORMAT_SPECS, Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.errors import MissingDependencyError
from kvactors.kernels.fast import index_tensor

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.runtime import Runtime

__all__ = (
    "MODELS",
    "PercallReport",
    "PercallRow",
    "format_percall",
    "main",
    "plot_percall",
    "run_percall_bench",
)

MODELS: dict[str, tuple[int, int, int]] = {"small": (8, 4, 64), "8b": (32, 8, 128)}
"""Model sizes: ``(layers, KV heads, head size)``; MLA uses one head of ``head*4.5``."""

_FORMATS = {
    "nhd": KVFormat.NL_X_TWO_NB_BS_NH_HS,
    "hnd": KVFormat.NL_X_TWO_NB_NH_BS_HS,
    "mla": KVFormat.NL_X_NB_BS_HS,
    "kv_list": KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
    "fused": KVFormat.NL_X_NB_NH_BS_CS,  # vLLM CPU attention's [NB, NH, BS, 2*HS]
}
DEFAULT_LAYOUTS = ("nhd", "hnd", "mla", "kv_list")
"""What a run without ``--layouts`` measures (``fused`` on request)."""
CONTENDERS = ("torch", "runtime", "op", "lmcache")
_BS, _TOKENS = 16, 256
_ID_SETS = 384  # above the runtime's plan cache capacity (256)
_BUF_STEP = 64  # elements between two chunk buffers of the pool (``bufs`` cases)


class PercallRow(msgspec.Struct, frozen=True, kw_only=True):
    """One case: latencies in microseconds (``p50``/``p99`` per contender) and ratios."""

    model: str
    layout: str
    direction: str
    callers: int
    ids: str = "same"
    """``same``: every call repeats its block ids; ``fresh``: every call brings other ids
    (more sets than the plan cache holds), as LMCache's traffic does; ``bufs``: other ids and
    another chunk buffer on every call (views at other offsets of one host pool, more than
    the plan cache holds), as a store into buffers of LMCache's host pool brings."""
    nbytes: int
    reps: int
    p50_us: dict[str, float]
    p99_us: dict[str, float]
    calls_per_s: dict[str, float]
    vs_torch: dict[str, float]
    op_vs_lmcache: float | None


class PercallReport(msgspec.Struct, kw_only=True):
    """Everything one per-call run measured."""

    rows: list[PercallRow]
    plan_warm_us: float
    plan_cold_us: float
    ping_us: float
    seconds: float = 0.0


def _baseline(name: str) -> Callable[..., Callable[[], None]] | None:
    for ep in entry_points(group="kvactors.baselines"):
        if ep.name == name:
            try:
                return ep.load()  # type: ignore[no-any-return]
            except Exception:
                return None
    return None


class _Case:
    """Operands of one model x layout: a stacked pool and per-caller chunks and block ids."""

    def __init__(self, model: str, layout: str, callers: int, seed: int) -> None:
        nl, nh, hs = MODELS[model]
        self.fmt = _FORMATS[layout]
        spec = FORMAT_SPECS[self.fmt]
        if spec.is_mla:
            nh, hs = 1, hs * 9 // 2
        if spec.single_plane:
            hs *= 2  # the packed K|V width
        bpo = _TOKENS // _BS
        nb = bpo * callers * (1 if model != "small" else 4)
        dtype = torch.bfloat16
        unit = spec.tensor_shape(nl, nb, _BS, nh, hs)
        self.paged: Any
        if spec.is_kv_list:
            self.pool = torch.ones((2, nl, *unit), dtype=dtype)
            self.paged = [list(self.pool[0].unbind(0)), list(self.pool[1].unbind(0))]
            self.stacked, self.block_dim = self.pool, 2  # [2, L, B, S, H, D]
        else:
            self.pool = torch.ones((nl, *unit), dtype=dtype)
            self.paged = list(self.pool.unbind(0))
            self.stacked, self.block_dim = self.pool, 1 + spec.axes.index("B")
        oshape = spec.object_shape(nl, _TOKENS, nh, hs)
        self.objects = [[torch.zeros(oshape, dtype=dtype)] for _ in range(callers)]
        rng = random.Random(seed)
        ids = rng.sample(range(nb), bpo * callers)
        self.ids = [tuple(ids[c * bpo : (c + 1) * bpo]) for c in range(callers)]
        # Per caller, more sets of other ids than the plan cache holds (fresh-id cases).
        self.id_sets = [[tuple(rng.sample(range(nb), bpo)) for _ in range(_ID_SETS)]] * callers
        self.ids_t = [torch.tensor(i, dtype=torch.int64) for i in self.ids]
        self.spec, self.nl, self.nh, self.hs, self.bpo = spec, nl, nh, hs, bpo
        self.shape = ShapeDesc(
            kv_size=spec.planes,
            nl=nl,
            nb=nb,
            bs=_BS,
            nh=nh,
            hs=hs,
            element_size=2,
            dtype="bfloat16",
        )
        self.nbytes = self.objects[0][0].nbytes
        self._buffers: dict[int, list[list[torch.Tensor]]] = {}

    def buffer_sets(self, c: int) -> list[list[torch.Tensor]]:
        """Caller ``c``'s chunk buffers for the ``bufs`` cases: views at other offsets of one
        pool (they overlap: the figure is the host's cost per call, not the pool's memory)."""
        sets = self._buffers.get(c)
        if sets is None:
            obj = self.objects[c][0]
            pool = torch.zeros(obj.numel() + _ID_SETS * _BUF_STEP, dtype=obj.dtype)
            n = obj.numel()
            sets = self._buffers[c] = [
                [pool[k * _BUF_STEP : k * _BUF_STEP + n].view(obj.shape)] for k in range(_ID_SETS)
            ]
        return sets

    def request(self, c: int, direction: Direction) -> TransferRequest:
        return TransferRequest(
            fmt=int(self.fmt),
            direction=int(direction),
            block_ids=self.ids[c],
            chunk_size=_TOKENS,
            shape=self.shape,
        )

    def chunk_view(self, c: int, obj: torch.Tensor | None = None) -> torch.Tensor:
        """Caller ``c``'s chunk (or ``obj``) seen in the stacked pool's axis order, blocks on
        block_dim."""
        obj = self.objects[c][0] if obj is None else obj
        nl, j, s, h, d = self.nl, self.bpo, _BS, self.nh, self.hs
        if self.spec.is_mla:
            return obj.view(nl, j, s, d)  # pool [L, B, S, D]
        if self.spec.single_plane:
            v = obj.view(nl, j, s, h, d)  # [L, J, S, H, D]
            return v.permute(0, 1, 3, 2, 4) if self.spec.is_hnd else v  # pool [L, B, H, S, D]
        v = obj.view(2, nl, j, s, h, d)  # [P, L, J, S, H, D]
        if self.spec.is_kv_list:
            return v  # pool [P, L, B, S, H, D]
        if self.spec.is_hnd:
            return v.permute(1, 0, 2, 4, 3, 5)  # pool [L, P, B, H, S, D]
        return v.permute(1, 0, 2, 3, 4, 5)  # pool [L, P, B, S, H, D]

    def torch_call(
        self, c: int, direction: Direction, fresh: bool = False, buffers: bool = False
    ) -> Callable[[], None]:
        view, ids, dim, pool = self.chunk_view(c), self.ids_t[c], self.block_dim, self.stacked
        if buffers:  # another chunk buffer too: the call's view of it
            ring = itertools.cycle(
                [
                    (list(i), self.chunk_view(c, b[0]))
                    for i, b in zip(self.id_sets[c], self.buffer_sets(c), strict=True)
                ]
            )
            tensor = index_tensor
            if direction is Direction.D2H:

                def gather_buffers() -> None:
                    i, out = next(ring)
                    torch.index_select(pool, dim, tensor(i), out=out)

                return gather_buffers

            def scatter_buffers() -> None:
                i, src = next(ring)
                pool.index_copy_(dim, tensor(i), src)

            return scatter_buffers
        if fresh:  # the index tensor is built from the call's id list, as any caller must
            sets = itertools.cycle([list(i) for i in self.id_sets[c]])
            tensor = index_tensor  # the cheapest way there is (kvactors' own, too)
            if direction is Direction.D2H:

                def gather_fresh() -> None:
                    torch.index_select(pool, dim, tensor(next(sets)), out=view)

                return gather_fresh

            def scatter_fresh() -> None:
                pool.index_copy_(dim, tensor(next(sets)), view)

            return scatter_fresh
        if direction is Direction.D2H:

            def gather() -> None:
                torch.index_select(pool, dim, ids, out=view)

            return gather

        def scatter() -> None:
            pool.index_copy_(dim, ids, view)

        return scatter


def _contenders(
    cases: dict[str, _Case],
    c: int,
    direction: Direction,
    rt: Runtime,
    fresh: bool = False,
    buffers: bool = False,
) -> dict[str, Callable[[], None]]:
    """Caller ``c``'s call of every contender, each on its own copy of the operands (same
    shapes, ids and values): a contender's writes must not count as changes of another's.
    ``fresh``: every call takes the next of the case's id sets; ``buffers``: and the next of
    its chunk buffers."""
    out: dict[str, Callable[[], None]] = {
        "torch": cases["torch"].torch_call(c, direction, fresh, buffers)
    }
    case = cases["runtime"]
    req, paged, objs = case.request(c, direction), case.paged, case.objects[c]
    if buffers:
        ring = itertools.cycle(list(zip(case.id_sets[c], case.buffer_sets(c), strict=True)))
        replace = msgspec.structs.replace

        def through_buffers() -> None:
            ids, bufs = next(ring)
            rt.transfer(replace(req, block_ids=ids), paged, bufs)

        out["runtime"] = through_buffers
    elif fresh:
        sets = itertools.cycle(case.id_sets[c])
        replace = msgspec.structs.replace

        def through_fresh() -> None:
            rt.transfer(replace(req, block_ids=next(sets)), paged, objs)

        out["runtime"] = through_fresh
    else:

        def through() -> None:
            rt.transfer(req, paged, objs)

        out["runtime"] = through
    for name, ep in (("op", "kvactors_op"), ("lmcache", "lmcache_torch")):
        make = _baseline(ep)
        if make is not None:
            case = cases[name]
            args = (case.request(c, direction), case.paged, case.objects[c])
            with contextlib.suppress(ImportError):  # the adapter is there, lmcache is not
                if buffers:
                    out[name] = make(*args, case.id_sets[c], case.buffer_sets(c))
                else:
                    out[name] = make(*args, case.id_sets[c]) if fresh else make(*args)
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _one_caller(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for fn in fns.values():  # warm: plans, buffers, first-touch
        fn()
        fn()
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            fn = fns[n]
            t0 = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - t0)
    return times


def _many_callers(
    per_caller: list[dict[str, Callable[[], None]]], reps: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each contender in turn: every caller thread runs ``reps`` calls at once; repeated
    ``rounds`` times with the contender order rotated. Returns per-call latencies and the
    median aggregate calls per second."""
    names = list(per_caller[0])
    lat: dict[str, list[float]] = {n: [] for n in names}
    rate: dict[str, list[float]] = {n: [] for n in names}
    for fns in per_caller:
        for fn in fns.values():
            fn()
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            start = threading.Barrier(len(per_caller) + 1)
            samples: list[list[float]] = [[] for _ in per_caller]

            def work(
                i: int,
                n: str = n,
                start: threading.Barrier = start,
                samples: list[list[float]] = samples,
            ) -> None:
                fn = per_caller[i][n]
                start.wait()
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    samples[i].append(time.perf_counter() - t0)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(per_caller))]
            for t in threads:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            rate[n].append(reps * len(per_caller) / wall)
            for s in samples:
                lat[n].extend(s)
    return lat, {n: statistics.median(v) for n, v in rate.items()}


def _row(
    case: _Case,
    model: str,
    layout: str,
    direction: Direction,
    callers: int,
    reps: int,
    times: dict[str, list[float]],
    rates: dict[str, float] | None,
    ids: str = "same",
) -> PercallRow:
    p50 = {n: statistics.median(v) * 1e6 for n, v in times.items()}
    p99 = {n: _pct(v, 0.99) * 1e6 for n, v in times.items()}
    cps = rates if rates is not None else {n: 1e6 / v for n, v in p50.items()}
    vs = {n: (cps["torch"] / cps[n]) for n in cps if n != "torch"}
    # op time over LMCache torch-path time (below 1: the op is faster).
    ovl = cps["lmcache"] / cps["op"] if "op" in cps and "lmcache" in cps else None
    return PercallRow(
        model=model,
        layout=layout,
        direction="gather" if direction is Direction.D2H else "scatter",
        callers=callers,
        ids=ids,
        nbytes=case.nbytes,
        reps=reps,
        p50_us=p50,
        p99_us=p99,
        calls_per_s=cps,
        vs_torch=vs,
        op_vs_lmcache=ovl,
    )


def _planning(rt: Runtime, case: _Case, reps: int) -> tuple[float, float, float]:
    """Median warm planning (the runtime's plan cache, a repeated request), cold planning
    (full validation) and ``Runtime.ping``, in microseconds."""
    from kvactors.core.plan_cache import PlanCache
    from kvactors.core.plans import plan_transfer

    req = case.request(0, Direction.D2H)
    paged, objs = case.paged, case.objects[0]
    cache = PlanCache("cpu", 0)
    cache.lookup(req, paged, objs)
    warm: list[float] = []
    cold: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan_transfer(req, paged, objs, device_type="cpu", device_index=0)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.lookup(req, paged, objs)
        warm.append(time.perf_counter() - t0)
    pings: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        rt.ping()
        pings.append(time.perf_counter() - t0)
    med = statistics.median
    return med(warm) * 1e6, med(cold) * 1e6, med(pings) * 1e6


def run_percall_bench(
    *,
    quick: bool = False,
    models: Sequence[str] = ("small", "8b"),
    layouts: Sequence[str] = DEFAULT_LAYOUTS,
    directions: Sequence[str] = ("gather", "scatter"),
    callers: Sequence[int] = (1, 4),
    reps: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> PercallReport:
    """Run the per-call cases (see the module docstring); 1 torch thread."""
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    step = progress or (lambda _s: None)
    rows: list[PercallRow] = []
    with Runtime("cpu", default_timeout=120.0) as rt:
        for model in models:
            for layout in layouts:
                if model != "small" and layout != "nhd":
                    continue  # the large model is the NHD bandwidth case only
                big = model != "small"
                for n_callers in callers:
                    if big and quick and n_callers > 1:
                        continue
                    cases = {n: _Case(model, layout, n_callers, seed) for n in CONTENDERS}
                    case = cases["torch"]
                    for d in directions:
                        direction = Direction.D2H if d == "gather" else Direction.H2D
                        per = [_contenders(cases, c, direction, rt) for c in range(n_callers)]
                        if n_callers == 1:
                            r = reps or ((15 if quick else 40) if big else (60 if quick else 300))
                            times, rates = _one_caller(per[0], r), None
                        else:
                            r = reps or ((3 if quick else 10) if big else (20 if quick else 60))
                            times, rates = _many_callers(per, r, 3 if quick else 5)
                        rows.append(
                            _row(case, model, layout, direction, n_callers, r, times, rates)
                        )
                        step(f"percall {model} {layout} {d} x{n_callers}")
                        if n_callers == 1 and not big:  # other block ids on every call
                            fresh = _contenders(cases, 0, direction, rt, fresh=True)
                            times = _one_caller(fresh, r)
                            rows.append(
                                _row(case, model, layout, direction, 1, r, times, None, "fresh")
                            )
                            step(f"percall {model} {layout} {d} x1 fresh ids")
                            bufs = _contenders(cases, 0, direction, rt, fresh=True, buffers=True)
                            times = _one_caller(bufs, r)
                            rows.append(
                                _row(case, model, layout, direction, 1, r, times, None, "bufs")
                            )
                            step(f"percall {model} {layout} {d} x1 fresh ids and buffers")
                    del cases, case, per
        plan_warm, plan_cold, ping = _planning(
            rt, _Case("small", "nhd", 1, seed), 200 if quick else 1000
        )
    return PercallReport(
        rows=rows,
        plan_warm_us=plan_warm,
        plan_cold_us=plan_cold,
        ping_us=ping,
        seconds=time.perf_counter() - t_start,
    )


def format_percall(report: PercallReport) -> str:
    """The report as a text table (p50 latencies in us, ratios vs the single torch call)."""
    head = (
        f"{'model':<6}{'layout':<8}{'dir':<8}{'call':>5}{'ids':>6}{'torch':>9}{'runtime':>9}"
        f"{'op':>9}{'lmcache':>9}{'rt/t':>7}{'op/t':>7}{'op p99/p50':>11}{'t p99/p50':>10}"
        f"{'op/lmc':>8}"
    )
    lines = ["per-call p50 (us); ratios are time per call vs the single torch call", head]
    for r in report.rows:

        def g(d: dict[str, float], k: str, fmt: str = "9.0f") -> str:
            return format(d[k], fmt) if k in d else " " * (int(fmt[0]) - 1) + "-"

        p99r = f"{r.p99_us['op'] / r.p50_us['op']:11.2f}" if "op" in r.p50_us else " " * 10 + "-"
        tp99 = f"{r.p99_us['torch'] / r.p50_us['torch']:10.2f}"  # the machine's own tail
        lmc = f"{r.op_vs_lmcache:8.2f}" if r.op_vs_lmcache is not None else " " * 7 + "-"
        lines.append(
            f"{r.model:<6}{r.layout:<8}{r.direction:<8}{r.callers:>5}{r.ids:>6}"
            f"{g(r.p50_us, 'torch')}{g(r.p50_us, 'runtime')}{g(r.p50_us, 'op')}"
            f"{g(r.p50_us, 'lmcache')}{g(r.vs_torch, 'runtime', '7.2f')}"
            f"{g(r.vs_torch, 'op', '7.2f')}{p99r}{tp99}{lmc}"
        )
    lines.append(
        f"planning: warm {report.plan_warm_us:.1f} us, cold {report.plan_cold_us:.1f} us;"
        f" Runtime.ping {report.ping_us:.1f} us"
    )
    return "\n".join(lines)


def plot_percall(report: PercallReport, path: str) -> None:
    """Write the per-call figure (time per call relative to the single torch call, per case
    and contender; p50 bars, p99 ticks) to ``path`` (PNG; needs matplotlib)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(
            "the bench plot needs matplotlib: pip install 'kvactors[bench]'", package="matplotlib"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    names = [n for n in ("runtime", "op", "lmcache") if any(n in r.vs_torch for r in rows)]
    colors = {"runtime": "#1f77b4", "op": "#2ca02c", "lmcache": "#d62728"}
    labels = {
        "runtime": "Runtime.transfer",
        "op": "LMCache op (kvactors_cpu)",
        "lmcache": "LMCache torch path",
    }
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(rows) + 2), 5), dpi=110)
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [r.vs_torch.get(n, 0.0) for r in rows], width, color=colors[n], label=labels[n])
        p99 = [r.p99_us[n] / r.p50_us["torch"] if n in r.p99_us else 0.0 for r in rows]
        ax.scatter(xs, p99, marker="_", color="black", s=40, zorder=3)
    ax.axhline(1.0, color="#7f7f7f", lw=1, label="one torch call")
    ax.set_xticks(
        range(len(rows)),
        [
            f"{r.model} {r.layout}\n{r.direction} x{r.callers}"
            + {"fresh": "\nfresh ids", "bufs": "\nids+buffers"}.get(r.ids, "")
            for r in rows
        ],
        fontsize=7,
        rotation=0,
    )
    ax.set_ylabel("time per call / single torch call (p50; ticks: p99)")
    ax.set_yscale("log")
    ax.set_title(
        f"per-call cost, 1 chunk of {_TOKENS} tokens, bf16, 1 torch thread; warm "
        f"planning {report.plan_warm_us:.0f} us, ping {report.ping_us:.0f} us",
        fontsize=9,
    )
    ax.legend(fontsize=8, ncols=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvactors.cli.bench.percall [--quick] [--json FILE]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    ap.add_argument("--layouts", nargs="+", choices=tuple(_FORMATS), default=list(DEFAULT_LAYOUTS))
    ap.add_argument(
        "--directions", nargs="+", choices=("gather", "scatter"), default=["gather", "scatter"]
    )
    ap.add_argument("--callers", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--plot", default=None, metavar="PNG")
    args = ap.parse_args(argv)
    report = run_percall_bench(
        quick=args.quick,
        models=args.models,
        layouts=args.layouts,
        directions=args.directions,
        callers=args.callers,
        reps=args.reps,
    )
    print(format_percall(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(msgspec.to_builtins(report), f, indent=2)
    if args.plot:
        plot_percall(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
