"""Property tests: fast == reference bit for bit, nothing outside the moved blocks changes,
and every rejected request leaves every buffer as it was."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvactors.core.layouts import KVFormat
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.errors import OperandTypeError, TransferValidationError
from kvactors.kernels.fast import ScratchCache, run_fast
from kvactors.kernels.reference import run_reference
from tests._transfer_cases import ALLOCS, Case, block_view, dtypes, same_bytes, snapshot

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw: st.DrawFn) -> tuple[Case, int, list[int], int]:
    fmt = draw(st.sampled_from(list(KVFormat)))
    mla = fmt is KVFormat.NL_X_NB_BS_HS
    nb = draw(st.integers(1, 7))
    # small sizes make the ambiguous shapes (NB == NH, BS == NH, BS == HS) common
    c = Case(
        fmt=fmt,
        nl=draw(st.integers(1, 3)),
        nb=nb,
        bs=draw(st.integers(1, 3)),
        nh=1 if mla else draw(st.integers(1, 3)),
        hs=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(dtypes())),
        alloc=draw(st.sampled_from(ALLOCS)),
        seed=draw(st.integers(0, 2**16)),
        n_objects=draw(st.integers(0, 3)),
        bpo=draw(st.integers(1, 3)),
        mla_4d=draw(st.booleans()),
        declare_stride=draw(st.booleans()),
        split_width=draw(st.booleans()),
    )
    direction = draw(st.sampled_from([0, 1]))
    n = draw(st.integers(0, min(nb, c.n_objects * c.bpo + 1)))
    if direction == 0:
        ids = draw(st.permutations(range(nb)))[:n]
    else:
        ids = draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    skip = draw(st.integers(0, c.n_objects * c.bpo + 1))
    return c, direction, list(ids), skip


def _run(c: Case, direction: int, ids: list[int], skip: int, kernel: str) -> Any:
    paged, objs, backing = c.build()
    plan = plan_transfer(c.request(direction, ids, skip), paged, objs, device_type="cpu")
    if kernel == "reference":
        run_reference(plan, paged, objs)
    else:
        run_fast(plan, paged, objs, staged=kernel == "staged", scratch=ScratchCache())
    return plan, paged, objs, backing


@SETTINGS
@given(cases(), st.sampled_from(["host", "staged"]))
def test_fast_equals_reference_bit_exact(case: Any, kernel: str) -> None:
    c, direction, ids, skip = case
    _, _, objs_a, back_a = _run(c, direction, ids, skip, "reference")
    _, _, objs_b, back_b = _run(c, direction, ids, skip, kernel)
    assert same_bytes(back_a, back_b)
    assert same_bytes(objs_a, objs_b)


@SETTINGS
@given(cases())
def test_only_planned_bytes_change(case: Any) -> None:
    c, direction, ids, skip = case
    paged0, objs0, back0 = c.build()  # pristine copy
    plan, paged, objs, backing = _run(c, direction, ids, skip, "host")
    planes = 1 if c.spec.is_mla else 2
    if direction == 1:
        assert same_bytes(backing, back0)  # a gather never writes paged memory
        # undo the covered rows; then every object must be pristine again
        for s in plan.segments:
            lo, hi = s.row0, s.row0 + s.count * c.bs
            view = objs[s.obj].view(-1, c.nl, c.bpo * c.bs, objs[s.obj].shape[-1])
            pristine = objs0[s.obj].view_as(view)
            view[:, :, lo:hi] = pristine[:, :, lo:hi]
        assert same_bytes(objs, objs0)
    else:
        assert same_bytes(objs, objs0)  # a scatter never writes objects
        for b in plan.touched_blocks:
            for layer in range(c.nl):
                for p in range(planes):
                    block_view(c.fmt, paged, c.nl, layer, p, b).copy_(
                        block_view(c.fmt, paged0, c.nl, layer, p, b)
                    )
        assert same_bytes(backing, back0)  # incl. gaps, padding and untouched blocks


def _mutations(c: Case, r: TransferRequest, paged: Any, objs: list[torch.Tensor]) -> list[Any]:
    sd = r.shape
    rep = msgspec.structs.replace
    flat = paged if isinstance(paged, torch.Tensor) else list(paged)
    out: list[Any] = [
        (rep(r, chunk_size=0), paged, objs),
        (rep(r, chunk_size=c.bs * c.bpo + 1 if c.bs > 1 else 0), paged, objs),
        (rep(r, skip_blocks=-1), paged, objs),
        (rep(r, direction=2), paged, objs),
        (rep(r, fmt=5), paged, objs),
        (rep(r, shape=rep(sd, nb=sd.nb + 1)), paged, objs),
        (rep(r, shape=rep(sd, hs=sd.hs + 1)), paged, objs),
        (rep(r, shape=rep(sd, nl=sd.nl + 1)), paged, objs),
        (rep(r, shape=rep(sd, dtype="float64")), paged, objs),
        (rep(r, block_ids=(*r.block_ids, sd.nb)), paged, objs),
        (r, paged, [*objs, torch.zeros(3)]),
        (r, paged, [o.to(torch.float64) for o in objs] or [torch.zeros(1)]),
        (r, "paged", objs),
        (r, paged, objs, "mlu"),
    ]
    if not isinstance(flat, torch.Tensor) and len(flat) > 1:
        out.append((r, flat[:-1] if c.spec.kind.value == "layer_list" else flat[:1], objs))
    return out


def _plan_and_run(req: TransferRequest, paged: Any, objs: Any, device_type: str) -> None:
    plan = plan_transfer(req, paged, objs, device_type=device_type)
    run_fast(plan, paged, objs)  # must never be reached


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_rejected_requests_touch_nothing(case: Any) -> None:
    c, direction, ids, skip = case
    paged, objs, backing = c.build()
    r = c.request(direction, ids, skip)
    before_b, before_o = snapshot(backing), snapshot(objs)
    for m in _mutations(c, r, paged, objs):
        req, pg, ob = m[0], m[1], m[2]
        dev = m[3] if len(m) > 3 else "cpu"
        with pytest.raises((TransferValidationError, OperandTypeError)) as ei:
            _plan_and_run(req, pg, ob, dev)
        assert isinstance(ei.value, (ValueError, TypeError))
        assert same_bytes(backing, before_b)
        assert same_bytes(objs, before_o)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_h2d_duplicates_rejected_before_any_write(case: Any) -> None:
    c, _, _, _ = case
    c = dataclasses.replace(c, n_objects=max(c.n_objects, 1), bpo=max(c.bpo, 2))
    paged, objs, backing = c.build()
    before = snapshot(backing)
    with pytest.raises(TransferValidationError):
        plan_transfer(c.request(0, [0, 0]), paged, objs, device_type="cpu")
    assert same_bytes(backing, before)
