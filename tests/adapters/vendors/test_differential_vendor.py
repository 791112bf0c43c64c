"""Byte for byte against LMCache's own MLU and MUSA ops, on the fake vendors.

LMCache's ``MluDeviceOps`` (0.5.7) and ``MusaDeviceOps`` run unmodified on the fakes next to
kvactors' plugin, on identical operands, over seeded random cases: both succeed with identical
chunks and caches, or LMCache refuses and kvactors refuses the same cases before touching
anything (``REFUSED``). One vendor per process: the other vendor's cases run under
``KVACTORS_FAKE_VENDOR=<kind>`` (scripts/test.sh). A vendor whose ops the installed LMCache
version predates (``PREDATES``) is not collected there; the 0.5.7rc2 lane runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import random
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.core.layouts import KVFormat
from kvactors.testing import fake_vendor
from kvactors.testing.pytest_plugin import require_torch_devices
from tests._transfer_cases import Case, raw

from ..conftest import LMCACHE_MISSING, SKIP_REASON

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.testing import FakeVendor

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

F = KVFormat
#: LMCache's own ops and the formats its backend serves there (lmcache-057.md section 1, 3).
VENDORS: dict[str, tuple[str, str, str, frozenset[KVFormat]]] = {
    "mlu": (
        "lmcache.v1.platform.devices.mlu.device_ops",
        "MluDeviceOps",
        "KvactorsMluOps",
        frozenset({F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_HS}),
    ),
    "musa": (
        "lmcache.v1.platform.devices.musa.device_ops",
        "MusaDeviceOps",
        "KvactorsMusaOps",
        frozenset({F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS, F.TWO_X_NL_X_NB_BS_NH_HS}),
    ),
}
#: Layouts LMCache's backend refuses and kvactors deliberately serves (docs/comparison.md).
REFUSED: dict[str, frozenset[KVFormat]] = {
    "mlu": frozenset({F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS, F.TWO_X_NL_X_NB_BS_NH_HS}),
    "musa": frozenset({F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS}),
}
#: Formats kvactors serves on CPU only: LMCache's MLU and MUSA ops refuse them, and so does
#: kvactors there (docs/formats.md).
CPU_ONLY = frozenset(
    {
        F.NB_NL_TWO_NH_BS_HS,
        F.NL_X_NB_NH_BS_TWO_HS,
        F.NL_X_NB_BS_NH_TWO_HS,
        F.NL_X_NB_NH_BS_CS,
        F.NL_X_NB_BS_NH_CS,
        F.NL_X_TWO_X_NB_BS_NH_HS,
        F.NL_X_NB_BS_NH_HS,
    }
)
#: The vendors whose ops an LMCache version predates (LMCache's own MLU backend came in 0.5.7):
#: their cases are not collected there. Ops missing on any other version fail the cases.
PREDATES: dict[str, frozenset[str]] = {"0.5.6": frozenset({"mlu"})}
_HERE = sorted(
    set(VENDORS)
    - PREDATES.get("" if LMCACHE_MISSING else importlib.metadata.version("lmcache"), frozenset())
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALLOCS = ("stacked", "separate", "gapped", "shuffled", "padded")
CASES = 60


def _lmcache_ops_class(kind: str) -> type[Any]:
    """LMCache's own ops for ``kind`` (missing ones fail: see ``PREDATES``)."""
    module, name, _, _ = VENDORS[kind]
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _desc(case: Case, ops: Any) -> Any:
    # The descriptor class LMCache builds while ``ops`` are the process-global ops: LMCache's
    # native one for its own, the kvactors descriptor for the kvactors ops.
    sd = type(ops).PageBufferShapeDesc()
    shape = case.shape()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(shape, f))
    sd.dtype = case.dtype
    return sd


def _on_device(fake: FakeVendor, paged: Any, backing: list[torch.Tensor]) -> Any:
    """The same views, over ``backing`` declared as fake device memory."""
    dev = {b.untyped_storage().data_ptr(): fake.adopt(b) for b in backing}

    def conv(t: Any) -> Any:
        if isinstance(t, (list, tuple)):
            return type(t)(conv(x) for x in t)
        base = dev[t.untyped_storage().data_ptr()]
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    return conv(paged)


class _Run:
    """One contender's call on freshly built operands: bytes after, or the refusal."""

    def __init__(self, case: Case, call: Any, fake: FakeVendor | None, args: tuple[Any, ...]):
        paged, objects, backing = case.build()
        self.before = [raw(t).clone() for t in (*objects, *backing)]
        operand = paged if fake is None else _on_device(fake, paged, backing)
        self.error: BaseException | None = None
        try:
            call(operand, objects, *args)
            if fake is not None:
                getattr(torch, fake.kind).synchronize()
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as exc:
            # RuntimeError: a device-side failure (LMCache's index_select on a bad block id
            # fails on the stream, after the call returned).
            self.error = exc
            if fake is not None:
                with contextlib.suppress(RuntimeError):
                    getattr(torch, fake.kind).synchronize()
        self.after = [raw(t).clone() for t in (*objects, *backing)]

    def same(self, other: _Run) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.after, other.after, strict=True))

    def untouched(self) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.before, self.after, strict=True))


def _random_case(kind: str, rng: random.Random, seed: int) -> tuple[Case, list[int], int, int]:
    fmt = rng.choice(sorted(VENDORS[kind][3]) * 3 + sorted(REFUSED[kind]))
    mla = fmt is F.NL_X_NB_BS_HS
    case = Case(
        fmt=fmt,
        nl=rng.randint(1, 3),
        nb=rng.randint(8, 14),
        bs=rng.choice((2, 4, 8)),
        nh=1 if mla else rng.randint(1, 3),
        hs=rng.choice((4, 8, 16)),
        dtype=rng.choice(DTYPES),
        alloc=rng.choice(ALLOCS),
        seed=seed,
        n_objects=rng.randint(1, 3),
        bpo=rng.randint(1, 3),
    )
    capacity = min(case.n_objects * case.bpo, case.nb)
    n_ids = rng.randint(max(1, capacity - case.bpo + 1), capacity)  # the last chunk may be partial
    ids = rng.sample(range(case.nb), n_ids)
    skip = rng.choice((0, 0, rng.randint(0, n_ids)))
    direction = rng.choice((0, 1))
    return case, ids, skip, direction


@pytest.fixture(params=_HERE)
def vendor(request: pytest.FixtureRequest) -> Iterator[tuple[str, FakeVendor, Any, Any]]:
    kind: str = request.param
    require_torch_devices(kind)
    lm_cls = _lmcache_ops_class(kind)
    import kvactors_lmcache.ops as kops
    from kvactors.devices.mlu import MluBackend
    from kvactors.runtime import Runtime

    with fake_vendor(kind, lazy=True) as fake:
        # LMCache 0.5.7 resolves vLLM-MLU's legacy layout answer itself, so format 1 reaching
        # the plugin is real NHD memory (as these operands are): declared resolved on MLU.
        backend = MluBackend(layout_source="resolved") if kind == "mlu" else kind
        rt = Runtime(backend, device_index=0, default_timeout=60.0).start()
        try:
            ours = getattr(kops, VENDORS[kind][2])(runtime_factory=lambda b, i: rt)
            yield kind, fake, lm_cls(), ours
        finally:
            rt.close()


def _transfer(ops: Any, case: Case, ids: list[int], skip: int, direction: int, dev: Any) -> Any:
    import lmcache.lmcache_native as native

    def call(paged: Any, objects: list[torch.Tensor]) -> None:
        ops.multi_layer_block_kv_transfer(
            paged, objects, list(ids), dev, native.TransferDirection(direction), _desc(case, ops),
            case.bpo * case.bs, native.EngineKVFormat(int(case.fmt)), skip,
        )  # fmt: skip

    return call


def _check(kind: str, fake: FakeVendor, lm: Any, ours: Any, spec: tuple[Any, ...]) -> str:
    case, ids, skip, direction = spec
    dev = torch.device(kind, 0)
    theirs = _Run(case, _transfer(lm, case, ids, skip, direction, dev), fake, ())
    mine = _Run(case, _transfer(ours, case, ids, skip, direction, dev), fake, ())
    label = f"{case} ids={ids} skip={skip} dir={'D2H' if direction else 'H2D'}"
    if theirs.error is None:
        assert mine.error is None, f"kvactors refused what LMCache serves: {label}: {mine.error}"
        assert mine.same(theirs), f"bytes differ from LMCache's {kind} ops: {label}"
        return "identical"
    assert mine.error is not None, (
        f"LMCache's {kind} ops refuse ({theirs.error!r}) but kvactors accepted: {label}"
    )
    assert mine.untouched(), f"kvactors refused but modified operands: {label}"
    return "refused"


def test_random_cases_match_lmcache_ops_byte_for_byte(vendor: tuple[Any, ...]) -> None:
    kind, fake, lm, ours = vendor
    rng = random.Random(f"differential-{kind}")
    outcomes: dict[str, int] = {}
    formats: set[KVFormat] = set()
    others: set[KVFormat] = set()
    for i in range(CASES):
        spec = _random_case(kind, rng, seed=1000 + i)
        got = _check(kind, fake, lm, ours, spec)
        outcomes[got] = outcomes.get(got, 0) + 1
        (formats if got == "identical" else others).add(spec[0].fmt)
    # The random cases must really have exercised every layout LMCache serves there, and
    # every layout it refuses there (kvactors refused each of those too, see _check).
    assert formats == set(VENDORS[kind][3]), (formats, outcomes)
    assert set(REFUSED[kind]) <= others, (others, outcomes)
    assert outcomes.get("identical", 0) >= CASES // 2, outcomes


def _refusal_specs(kind: str) -> list[tuple[str, tuple[Any, ...]]]:
    nhd = F.NL_X_TWO_NB_BS_NH_HS
    base: dict[str, Any] = {
        "nl": 2,
        "nb": 10,
        "bs": 4,
        "nh": 2,
        "hs": 8,
        "dtype": torch.bfloat16,
        "alloc": "separate",
        "seed": 5,
        "n_objects": 2,
        "bpo": 2,
    }
    return [
        ("negative skip", (Case(fmt=nhd, **base), [1, 2, 3], -1, 1)),
        ("chunk size not a block multiple", (Case(fmt=nhd, **base), [1, 2, 3], 0, 1)),
        ("block id out of range", (Case(fmt=nhd, **base), [1, 2, 99], 0, 1)),
    ]


@pytest.mark.parametrize(
    "what", ["negative skip", "chunk size not a block multiple", "block id out of range"]
)
def test_refusals_match(vendor: tuple[Any, ...], what: str) -> None:
    """Where LMCache's ops refuse, kvactors refuses too and leaves every byte alone."""
    kind, fake, lm, ours = vendor
    spec = dict(_refusal_specs(kind))[what]
    case, ids, skip, direction = spec
    dev = torch.device(kind, 0)
    if what == "chunk size not a block multiple":

        def odd(ops: Any) -> Any:
            import lmcache.lmcache_native as native

            def call(paged: Any, objects: list[torch.Tensor]) -> None:
                ops.multi_layer_block_kv_transfer(
                    paged, objects, list(ids), dev, native.TransferDirection(direction),
                    _desc(case, ops), case.bpo * case.bs - 1,
                    native.EngineKVFormat(int(case.fmt)), 0,
                )  # fmt: skip

            return call

        theirs = _Run(case, odd(lm), fake, ())
        mine = _Run(case, odd(ours), fake, ())
    else:
        theirs = _Run(case, _transfer(lm, case, ids, skip, direction, dev), fake, ())
        mine = _Run(case, _transfer(ours, case, ids, skip, direction, dev), fake, ())
    if theirs.error is None:
        pytest.fail(f"LMCache's {kind} ops accepted {what}; the refusal case is stale")
    assert mine.error is not None, f"kvactors accepted {what} (LMCache: {theirs.error!r})"
    assert mine.untouched()


@pytest.mark.parametrize("fmt", sorted(CPU_ONLY), ids=lambda f: f.name)
@pytest.mark.parametrize("direction", [0, 1])
def test_cpu_only_formats_are_refused_as_lmcache_refuses(
    vendor: tuple[Any, ...], fmt: KVFormat, direction: int
) -> None:
    kind, fake, lm, ours = vendor
    case = Case(
        fmt=fmt, nl=2, nb=10, bs=4, nh=2, hs=8, dtype=torch.bfloat16, alloc="separate",
        seed=7, n_objects=2, bpo=2,
    )  # fmt: skip
    assert _check(kind, fake, lm, ours, (case, [1, 4, 2, 7], 0, direction)) == "refused"


@pytest.mark.parametrize("skip", ["none", "block", "chunk"])
@pytest.mark.parametrize("direction", [0, 1])
def test_served_formats_with_the_engine_skips(
    vendor: tuple[Any, ...], direction: int, skip: str
) -> None:
    """Every format LMCache serves there, with the skips the engine-driven path produces
    (0, one block, one whole chunk), byte for byte."""
    kind, fake, lm, ours = vendor
    for fmt in sorted(VENDORS[kind][3]):
        case = Case(
            fmt=fmt, nl=2, nb=10, bs=4, nh=1 if fmt is F.NL_X_NB_BS_HS else 2, hs=8,
            dtype=torch.bfloat16, alloc="separate", seed=9, n_objects=3, bpo=2,
        )  # fmt: skip
        n = {"none": 0, "block": 1, "chunk": case.bpo}[skip]
        assert _check(kind, fake, lm, ours, (case, [8, 1, 4, 0, 6, 3], n, direction)) == (
            "identical"
        ), fmt


@pytest.mark.parametrize("direction", [0, 1])
def test_rbln_singleton_axis_format_as_lmcache_serves_it(
    vendor: tuple[Any, ...], direction: int
) -> None:
    """Format 15 (format 6 with a size-1 axis 3, docs/formats.md): LMCache's MLU ops refuse
    the rank, and kvactors moves the bytes LMCache's MLU ops move for the same memory as 6;
    LMCache's MUSA ops refuse format 15, and so does kvactors, touching nothing."""
    import lmcache.lmcache_native as native

    kind, fake, lm, ours = vendor
    case = Case(
        fmt=F.NL_X_TWO_NB_NH_BS_HS, nl=2, nb=10, bs=4, nh=2, hs=8, dtype=torch.bfloat16,
        alloc="separate", seed=3, n_objects=2, bpo=2,
    )  # fmt: skip
    ids, skip, dev = [5, 2, 9, 0], 1, torch.device(kind, 0)

    def singleton(ops: Any) -> Any:
        def call(paged: Any, objects: list[torch.Tensor]) -> None:
            ops.multi_layer_block_kv_transfer(
                [t.unsqueeze(3) for t in paged], objects, list(ids), dev,
                native.TransferDirection(direction), _desc(case, ops), case.bpo * case.bs,
                native.EngineKVFormat(15), skip,
            )  # fmt: skip

        return call

    mine = _Run(case, singleton(ours), fake, ())
    if kind == "musa":
        theirs = _Run(case, singleton(lm), fake, ())
        assert theirs.error is not None, "LMCache's MUSA ops served format 15: the case is stale"
        assert mine.error is not None, f"kvactors served format 15 on MUSA ({theirs.error!r})"
        assert mine.untouched()
        return
    theirs = _Run(case, _transfer(lm, case, ids, skip, direction, dev), fake, ())
    assert theirs.error is None, theirs.error
    assert mine.error is None, mine.error
    assert mine.same(theirs)
