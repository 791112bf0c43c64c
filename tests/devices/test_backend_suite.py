"""One backend suite for mlu and musa, on the kvactors.testing fakes (CPU) and real modules.

Each ordering test has a "broken" twin: a backend subclass (or a caller) with that one rule
removed, which must show wrong bytes. The fakes run lazily (``lazy=True``: device work runs
only once something waits for it), so the broken twin reads stale bytes every time, not by
chance, and the rule is what makes the correct variant pass.
"""

from __future__ import annotations

import importlib.util
import random
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import KVFormat
from kvactors.core.plans import plan_transfer
from kvactors.devices import get_backend
from kvactors.devices.mlu import MluBackend
from kvactors.devices.musa import MusaBackend
from kvactors.kernels.fast import ScratchCache, run_fast
from kvactors.kernels.reference import run_reference
from kvactors.testing import fake_vendor
from tests._transfer_cases import Case
from tests.devices._helpers import FAKE_KINDS, on_lane

if TYPE_CHECKING:
    from kvactors.devices.base import Backend, StreamLike

FORMATS = {
    "mlu": (KVFormat.NL_X_TWO_NB_NH_BS_HS, KVFormat.NL_X_NB_BS_HS, KVFormat.NL_X_TWO_NB_BS_NH_HS),
    "musa": (
        KVFormat.NL_X_TWO_NB_BS_NH_HS,
        KVFormat.NL_X_NB_BS_HS,
        KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
    ),
}
BACKENDS: dict[str, type[MluBackend] | type[MusaBackend]] = {"mlu": MluBackend, "musa": MusaBackend}
SEEDS = 6


def _real_params() -> list[Any]:
    mods = {"mlu": "torch_mlu", "musa": "torch_musa"}
    return [
        pytest.param(
            kind,
            marks=pytest.mark.skipif(
                importlib.util.find_spec(mod) is None,
                reason=f"{mod} real module absent (not hardware validation)",
            ),
        )
        for kind, mod in mods.items()
    ]


# ---- round trips ---------------------------------------------------------------------


def _device_paged(fake: Any, paged: Any) -> Any:
    if isinstance(paged, torch.Tensor):
        return fake.adopt(paged)
    return [_device_paged(fake, p) for p in paged]


def _round_trip(kind: str, fmt: KVFormat, seed: int) -> None:
    rng = random.Random(seed)
    nh = 1 if fmt is KVFormat.NL_X_NB_BS_HS else 2
    case = Case(
        fmt=fmt,
        nl=2,
        nb=8,
        bs=4,
        nh=nh,
        hs=8,
        dtype=torch.bfloat16,
        alloc=rng.choice(["stacked", "permuted", "padded", "separate"]),
        seed=seed,
        declare_stride=True,
    )
    ids = rng.sample(range(case.nb), 4)
    skip = rng.choice([0, 1])
    with fake_vendor(kind, lazy=True) as fake:
        backend = BACKENDS[kind]()
        src_cpu, _, src_backing = case.build()
        ref_paged, ref_objs, _ = case.build()
        dst_cpu, _, dst_backing = case.build()
        ref_dst, _, ref_dst_backing = case.build()
        for b in (*dst_backing, *ref_dst_backing):
            b.view(torch.uint8).zero_()
        objs = [torch.zeros(o.shape, dtype=o.dtype, pin_memory=True) for o in ref_objs]
        for o in ref_objs:
            o.zero_()
        src, dst = _device_paged(fake, src_cpu), _device_paged(fake, dst_cpu)
        d2h = plan_transfer(case.request(1, ids, skip), src, objs, device_type=kind, device_index=0)
        h2d = plan_transfer(case.request(0, ids, skip), dst, objs, device_type=kind, device_index=0)
        stream = backend.new_stream(0)
        scratch = ScratchCache()

        def work() -> None:
            backend.launch(
                stream, lambda: run_fast(d2h, src, objs, copy=backend.copy_, scratch=scratch)
            )
            backend.synchronize(stream)
            backend.launch(
                stream, lambda: run_fast(h2d, dst, objs, copy=backend.copy_, scratch=scratch)
            )
            backend.synchronize(stream)

        on_lane(backend, stream, work)
        ref_d2h = plan_transfer(case.request(1, ids, skip), ref_paged, ref_objs, device_type="cpu")
        run_reference(ref_d2h, ref_paged, ref_objs)
        ref_h2d = plan_transfer(case.request(0, ids, skip), ref_dst, ref_objs, device_type="cpu")
        run_reference(ref_h2d, ref_dst, ref_objs)
        for got, want in zip(objs, ref_objs, strict=True):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (fmt, seed)
        for got, want in zip(dst_backing, ref_dst_backing, strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (fmt, seed)
        del src_backing


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_round_trip_every_supported_layout_bit_exact_on_lazy_streams(kind: str) -> None:
    for fmt in FORMATS[kind]:
        for seed in range(SEEDS):
            _round_trip(kind, fmt, seed)


# ---- ordering rules and their broken twins -------------------------------------------


def _async_d2h_on(backend: Backend, fake: Any, stream: StreamLike) -> tuple[Any, torch.Tensor]:
    """Enqueue device work then an async D2H into pinned host on ``stream``; returns host."""
    n = 4096
    dev = fake.to_device(torch.zeros(n))
    host = torch.zeros(n, pin_memory=True)
    module = backend.module  # type: ignore[attr-defined]

    def work() -> None:
        with module.stream(stream):
            dev.fill_(3.0)
            backend.copy_(host, dev)

    work()
    return dev, host


class _Handle0ViaExternal(MluBackend):
    """Broken twin: handle 0 through ExternalStream(0) (a pool stream)."""

    def stream_from_handle(self, handle: int, index: int) -> StreamLike:
        return self.module.ExternalStream(handle, device=index)


class _MusaHandle0ViaExternal(MusaBackend):
    def stream_from_handle(self, handle: int, index: int) -> StreamLike:
        return self.module.ExternalStream(handle, device=index)


class _LaunchWithoutStream(MluBackend):
    """Broken twin: launch ignores the stream (work lands on the thread's current one)."""

    def launch(self, stream: StreamLike, fn: Any) -> None:
        fn()


class _MusaLaunchWithoutStream(MusaBackend):
    def launch(self, stream: StreamLike, fn: Any) -> None:
        fn()


BROKEN: dict[str, dict[str, type[Any]]] = {
    "handle0": {"mlu": _Handle0ViaExternal, "musa": _MusaHandle0ViaExternal},
    "launch": {"mlu": _LaunchWithoutStream, "musa": _MusaLaunchWithoutStream},
}


def _handle0_trial(kind: str, cls: type[Any]) -> bool:
    """Work on the default stream, then sync what handle 0 maps to; True = bytes correct."""
    with fake_vendor(kind, lazy=True) as fake:
        backend = cls()
        _, host = _async_d2h_on(backend, fake, backend.module.default_stream(0))
        backend.synchronize(backend.stream_from_handle(0, 0))
        ok = bool((host == 3.0).all())
        fake.synchronize()
        return ok


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_rule_handle0_is_default_stream(kind: str) -> None:
    assert _handle0_trial(kind, BACKENDS[kind])
    assert not _handle0_trial(kind, BROKEN["handle0"][kind])


def _launch_trial(kind: str, cls: type[Any]) -> bool:
    """launch on a side stream, synchronize that stream, read; True = bytes correct."""
    with fake_vendor(kind, lazy=True) as fake:
        backend = cls()
        side = backend.new_stream(0)
        dev = fake.to_device(torch.zeros(4096))
        host = torch.zeros(4096, pin_memory=True)

        def work() -> bool:
            backend.module.set_stream(backend.module.default_stream(0))  # lane default
            backend.launch(side, lambda: (dev.fill_(5.0), backend.copy_(host, dev)))
            backend.synchronize(side)
            return bool((host == 5.0).all())

        ok: bool = on_lane(backend, side, work)
        fake.synchronize()
        return ok


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_rule_launch_orders_work_on_its_stream(kind: str) -> None:
    assert _launch_trial(kind, BACKENDS[kind])
    assert not _launch_trial(kind, BROKEN["launch"][kind])


def _marker_trial(kind: str, *, wait: bool) -> bool:
    """Sync-then-publish: read after the marker (True) vs. right after launch (broken)."""
    with fake_vendor(kind, lazy=True) as fake:
        backend = BACKENDS[kind]()
        s = backend.new_stream(0)
        dev = fake.to_device(torch.zeros(4096))
        host = torch.zeros(4096, pin_memory=True)

        def work() -> bool:
            backend.launch(s, lambda: (dev.fill_(9.0), backend.copy_(host, dev)))  # type: ignore[arg-type]
            marker = backend.record_marker(s)
            if wait:
                marker.synchronize()
                assert marker.query()
            return bool((host == 9.0).all())

        ok: bool = on_lane(backend, s, work)
        fake.synchronize()
        return ok


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_marker_synchronize_waits_for_earlier_work(kind: str) -> None:
    """The backend's marker (what StreamActor syncs before publishing); the publication
    order itself is tested through the actors in tests/actors/test_ordering_rules.py and
    tests/adapters/vendors/test_lmcache_ops.py."""
    assert _marker_trial(kind, wait=True)
    assert not _marker_trial(kind, wait=False)


def _cross_stream_trial(kind: str, *, wait: bool) -> bool:
    """Producer writes on one stream, consumer copies out on another."""
    with fake_vendor(kind, lazy=True) as fake:
        backend = BACKENDS[kind]()
        prod, cons = backend.new_stream(0), backend.new_stream(0)
        dev = fake.to_device(torch.zeros(4096))
        host = torch.zeros(4096, pin_memory=True)
        backend.launch(prod, lambda: dev.fill_(4.0))  # type: ignore[arg-type]
        produced = backend.module.Event()  # type: ignore[attr-defined]
        produced.record(prod)

        def consume() -> None:
            if wait:
                cons.wait_event(produced)  # type: ignore[attr-defined]
            backend.copy_(host, dev)

        backend.launch(cons, consume)
        backend.synchronize(cons)
        ok = bool((host == 4.0).all())
        fake.synchronize()
        return ok


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_rule_consumer_waits_for_producer_marker(kind: str) -> None:
    assert _cross_stream_trial(kind, wait=True)
    assert not _cross_stream_trial(kind, wait=False)


def _strided_trial(kind: str, *, blocking: bool) -> bool:
    with fake_vendor(kind, strided_d2h_bug=True) as fake:
        backend = BACKENDS[kind](blocking_strided_d2h=blocking)
        s = backend.new_stream(0)
        src = fake.to_device(torch.arange(64.0).view(8, 8))
        wide = torch.zeros(8, 16, pin_memory=True)
        dst = wide[:, :8]
        assert backend.must_block(dst, src) is blocking
        backend.launch(s, lambda: backend.copy_(dst, src))
        backend.synchronize(s)
        return bool(torch.equal(dst, torch.arange(64.0).view(8, 8)))


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_rule_blocking_strided_d2h(kind: str) -> None:
    assert _strided_trial(kind, blocking=True)
    assert not _strided_trial(kind, blocking=False)


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_strided_bug_breaks_round_trip_without_policy(kind: str) -> None:
    """The kernels' partial-segment D2H goes through copy_: the policy is what saves it."""
    with fake_vendor(kind, strided_d2h_bug=True) as fake:
        case = Case(
            fmt=FORMATS[kind][0],
            nl=2,
            nb=8,
            bs=4,
            nh=2,
            hs=8,
            dtype=torch.float32,
            alloc="stacked",
            seed=1,
        )
        for blocking in (True, False):
            backend = BACKENDS[kind](blocking_strided_d2h=blocking)
            src_cpu, _, _ = case.build()
            ref_paged, ref_objs, _ = case.build()
            src = _device_paged(fake, src_cpu)
            objs = [torch.zeros(o.shape, dtype=o.dtype, pin_memory=True) for o in ref_objs]
            for o in ref_objs:
                o.zero_()
            req = case.request(1, [0, 1, 2, 3], 1)
            plan = plan_transfer(req, src, objs, device_type=kind, device_index=0)
            s = backend.new_stream(0)
            on_lane(
                backend,
                s,
                lambda p=plan, b=backend, st=s, src=src, objs=objs: (  # type: ignore[misc]
                    b.launch(st, lambda: run_fast(p, src, objs, copy=b.copy_)),
                    b.synchronize(st),
                ),
            )
            run_reference(
                plan_transfer(req, ref_paged, ref_objs, device_type="cpu"), ref_paged, ref_objs
            )
            same = all(
                torch.equal(a.view(torch.int32), b.view(torch.int32))
                for a, b in zip(objs, ref_objs, strict=True)
            )
            assert same is blocking


# ---- availability -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            k,
            marks=pytest.mark.skipif(
                importlib.util.find_spec(f"torch_{k}") is not None,
                reason=f"torch_{k} is installed here (not hardware validation)",
            ),
        )
        for k in FAKE_KINDS
    ],
)
def test_probe_without_vendor_module_reports_reason(kind: str) -> None:
    backend = get_backend(kind)
    probe = backend.probe()
    assert not probe.available
    assert f"torch_{kind}" in probe.reason
    from kvactors.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=f"torch_{kind}"):
        backend.require()


@pytest.mark.parametrize("kind", FAKE_KINDS)
def test_probe_with_fake_but_no_device(kind: str) -> None:
    with fake_vendor(kind, available=False):
        probe = get_backend(kind).probe()
        assert not probe.available
        assert "no " + kind.upper() + " device" in probe.reason


@pytest.mark.parametrize("kind", _real_params())
def test_real_module_probe_never_raises(kind: str) -> None:
    probe = get_backend(kind).probe()
    assert probe.backend == kind
