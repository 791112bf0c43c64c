"""Per-call host cost on CPU: kvactors through LMCache's op against the single torch call.

Per case (model, layout, direction; one chunk of 256 bf16 tokens, other block ids every call):
``torch``, the one ``index_select`` / ``index_copy_`` on the stacked pool making the same bytes,
and ``kvactors``, the ``kvactors_cpu`` op called as LMCache calls it (without LMCache:
``Runtime.transfer``), each with 1 and with 4 caller threads, the windows rotated. The four
callers' blocks lie apart, as concurrent requests' do (kvactors orders copies that write the
same blocks; torch's calls would race); the one caller cycles over all of their block sets.
"""

from __future__ import annotations

import array
import itertools
from typing import TYPE_CHECKING

import msgspec
import torch

from kvactors.cli.bench._harness import Lane, baseline, rates, table
from kvactors.cli.bench._pools import Pool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.runtime import Runtime

__all__ = ("CASES", "PercallRow", "format_percall", "run_percall")

CASES = (("small", "nhd"), ("small", "hnd"), ("small", "mla"), ("small", "kv_list"), ("8b", "nhd"))
"""Issue 28 item 4: the small model in every layout, the 8B-class model in NHD."""


class PercallRow(msgspec.Struct, frozen=True, kw_only=True):
    """One case. ``us`` (median time per call) and ``calls_per_s`` (aggregate) keyed
    ``<contender>@<callers>``; ``vs_torch``: kvactors' time per call over torch's (``1``:
    median call, ``4``: aggregate rate); ``scaling``: each one's calls/s with 4 callers over 1."""

    model: str
    layout: str
    direction: str
    kvactors_via: str
    us: dict[str, float]
    calls_per_s: dict[str, float]
    vs_torch: dict[str, float]
    scaling: dict[str, float]


def _torch_call(pool: Pool, c: int, gather: bool, step: int = 4) -> Callable[[], object]:
    """Caller ``c``'s one torch call: its chunk seen in the stacked pool's axis order, with
    the block sets ``[c::step]``."""
    view = pool.chunk_view(pool.objects[c])
    sets, stack, dim = itertools.cycle(pool.id_sets[c::step]), pool.stack, pool.block_dim
    assert stack is not None

    def index() -> torch.Tensor:  # the cheapest index tensor there is
        return torch.frombuffer(array.array("q", next(sets)), dtype=torch.int64)

    if gather:
        return lambda: torch.index_select(stack, dim, index(), out=view)
    return lambda: stack.index_copy_(dim, index(), view)


def _kvactors_call(
    pool: Pool, c: int, gather: bool, rt: Runtime, step: int = 4
) -> tuple[str, Callable[[], object]]:
    sets, objs = pool.id_sets[c::step], [pool.objects[c]]
    req = pool.request(1 if gather else 0, sets[0])
    make = baseline("kvactors_op")
    if make is not None:
        try:
            return "op", make(req, pool.paged, objs, sets)
        except ImportError:  # the adapter is installed but lmcache is not
            pass
    ring, replace = itertools.cycle([tuple(i) for i in sets]), msgspec.structs.replace
    return "runtime", lambda: rt.transfer(replace(req, block_ids=next(ring)), pool.paged, objs)


def run_percall(
    *,
    cases: Sequence[tuple[str, str]] = CASES,
    calls: int = 300,
    rounds: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[PercallRow]:
    """Measure every case in both directions (see the module docstring): ``calls`` per
    thread and window (the 8B-class model a tenth of them), ``rounds`` windows each."""
    from kvactors.runtime import Runtime

    torch.set_num_threads(1)
    rows: list[PercallRow] = []
    with Runtime("cpu", default_timeout=120.0) as rt:
        for model, layout in cases:
            nb = 256 if model == "small" else 64
            ours, theirs = Pool(model, layout, nb, 4), Pool(model, layout, nb, 4)  # apart
            for d in ("gather", "scatter"):
                gather = d == "gather"
                # Four callers on blocks apart (the sets [c::4]); one caller on every set,
                # the same blocks as the four together.
                torch_lanes = [Lane([("call", _torch_call(theirs, c, gather))]) for c in range(4)]
                mine = [_kvactors_call(ours, c, gather, rt) for c in range(4)]
                kva_lanes = [Lane([("call", fn)]) for _, fn in mine]
                n = max(calls // 10, 4) if model == "8b" else calls
                lanes = {
                    "torch@1": [Lane([("call", _torch_call(theirs, 0, gather, 1))])],
                    "kvactors@1": [Lane([("call", _kvactors_call(ours, 0, gather, rt, 1)[1])])],
                }
                got = rates({**lanes, "torch@4": torch_lanes, "kvactors@4": kva_lanes}, n, rounds)
                cps = {k: t.calls_per_s for k, t in got.items()}
                row = PercallRow(
                    model=model,
                    layout=layout,
                    direction=d,
                    kvactors_via=mine[0][0],
                    us={k: t.p50_us["call"] for k, t in got.items()},
                    calls_per_s=cps,
                    vs_torch={
                        "1": got["kvactors@1"].p50_us["call"] / got["torch@1"].p50_us["call"],
                        "4": cps["torch@4"] / cps["kvactors@4"],
                    },
                    scaling={k: cps[f"{k}@4"] / cps[f"{k}@1"] for k in ("torch", "kvactors")},
                )
                rows.append(row)
                if progress is not None:
                    progress(f"per call {model} {layout} {d}")
            del ours, theirs
    return rows


def format_percall(rows: Sequence[PercallRow]) -> str:
    """The rows as a text table: us per call with 1 caller, and the ratios."""
    head = ("model", "layout", "dir", "via", "torch us", "kva us", "kva/t 1", "kva/t 4")
    return table(
        "per call on CPU (kva/t: time per call over torch's; 4/1: calls/s, 4 callers over 1)",
        (*head, "kva 4/1", "t 4/1"),
        ((r.model, r.layout, r.direction, r.kvactors_via, r.us["torch@1"], r.us["kvactors@1"],
          r.vs_torch["1"], r.vs_torch["4"], r.scaling["kvactors"], r.scaling["torch"])
         for r in rows),
    )  # fmt: skip
