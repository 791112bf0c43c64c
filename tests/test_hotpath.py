"""The compiled hot path: its operand walk sees every fact the Python walk sees, declines what
it does not know, and its loader never runs a build made for another source or torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors import hotpath
from kvactors.errors import InvalidSettingError, MissingDependencyError
from kvactors.plan_cache import PlanCache

if TYPE_CHECKING:
    from collections.abc import Callable


@pytest.fixture
def native() -> hotpath.Hotpath:
    module = hotpath.load()
    if module is None:
        pytest.skip(f"the compiled hot path is not in use ({hotpath.status()})")
    return module


def _key(native: hotpath.Hotpath, paged: Any, objects: Any) -> tuple[bytes, bytes, int, bool]:
    found = native.operand_key(paged, objects)
    assert found is not None
    return found


def _pool() -> torch.Tensor:
    return torch.arange(4 * 2 * 8 * 16, dtype=torch.float32).view(4, 2, 8, 16)


# Each keeps the tensor inside its storage (the object's storage holds twice its view).
CHANGES: dict[str, Callable[[torch.Tensor], Any]] = {
    "data pointer": lambda t: t.clone(),
    "storage offset": lambda t: t.as_strided(t.shape, t.stride(), t.storage_offset() + 1),
    "shape": lambda t: t[:, :4],
    "stride": lambda t: t.as_strided(t.shape, (t.stride(0), 1, 8), t.storage_offset()),
    "dtype": lambda t: t.view(torch.int32),
    "device": lambda t: torch.empty_like(t, device="meta"),
}


@pytest.mark.parametrize("side", ["paged", "object"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_metadata_fact_is_in_the_key(native: hotpath.Hotpath, change: str, side: str) -> None:
    """The facts a validated plan depends on: change one, on either side, the key changes."""
    pool = _pool()
    obj = torch.zeros(4, 8, 16)[:2]
    before = _key(native, list(pool.unbind(0)), [obj])
    layers = list(pool.unbind(0))
    if side == "paged":
        layers[2] = CHANGES[change](layers[2])
    else:
        obj = CHANGES[change](obj)
    assert _key(native, layers, [obj])[0] != before[0]


def test_versions_are_apart_from_the_key(native: hotpath.Hotpath) -> None:
    """An in-place write (and set_, which re-points a tensor) moves the version counter, which
    is returned apart from the key: same key, other versions."""
    pool = _pool()
    layers = list(pool.unbind(0))
    obj = torch.zeros(2, 16)
    key, versions, n_paged, inference = _key(native, layers, [obj])
    assert (n_paged, inference) == (4, False)
    assert len(versions) == 8 * 5
    layers[1].add_(1)
    key2, versions2, _, _ = _key(native, layers, [obj])
    assert key2 == key
    assert versions2 != versions
    obj.set_(torch.zeros(2, 16))  # type: ignore[call-overload]
    key3, _, _, _ = _key(native, layers, [obj])
    assert key3 != key  # another storage: another pointer


def test_structure_is_in_the_key(native: hotpath.Hotpath) -> None:
    """List or tuple, nesting and lengths, and where the paged operands end."""
    a, b, c = (torch.zeros(4) for _ in range(3))
    keys = {
        _key(native, [a, b], [c])[0],
        _key(native, (a, b), [c])[0],
        _key(native, [a], [b, c])[0],
        _key(native, [[a], [b]], [c])[0],
        _key(native, [a, b], (c,))[0],
        _key(native, a, [b, c])[0],
    }
    assert len(keys) == 6


class _Sub(torch.Tensor):
    """A tensor subclass (the fake vendors' tensors are one): its Python methods may answer
    otherwise than its TensorImpl."""


@pytest.mark.parametrize(
    "paged",
    [
        pytest.param([1, 2], id="not a tensor"),
        pytest.param([[[[torch.zeros(2)]]]], id="too deep"),
        pytest.param({"k": torch.zeros(2)}, id="a dict"),
        pytest.param([torch.zeros(2, 2).to_sparse()], id="sparse"),
        pytest.param([torch.zeros(2).as_subclass(_Sub)], id="subclass"),
    ],
)
def test_anything_unknown_is_declined(native: hotpath.Hotpath, paged: Any) -> None:
    """``None``: the plan cache then takes the Python walk, with its own checks and errors."""
    assert native.operand_key(paged, [torch.zeros(2)]) is None


def test_objects_may_nest_one_level_less(native: hotpath.Hotpath) -> None:
    t = torch.zeros(2)
    assert native.operand_key([[t]], [[t]]) is not None
    assert native.operand_key([[t]], [[[t]]]) is None


def test_inference_tensors_are_flagged(native: hotpath.Hotpath) -> None:
    with torch.inference_mode():
        t = torch.zeros(4)
    _, versions, _, inference = _key(native, [t], [torch.zeros(4)])
    assert inference
    assert versions[:8] == (-1).to_bytes(8, "little", signed=True)


def test_compiled_and_python_caches_take_the_same_decisions(native: hotpath.Hotpath) -> None:
    """Both walks, one sequence of calls: hit, write (versions), new storage (miss)."""
    from kvactors.layouts import Direction, KVFormat, ShapeDesc
    from kvactors.plans import TransferRequest

    nl, nb, bs, nh, hs = 2, 8, 4, 2, 8
    base = torch.randn(nl, 2, nb, bs, nh, hs).to(torch.bfloat16)
    paged = list(base.unbind(0))
    objs = [torch.zeros(2, nl, 2 * bs, nh * hs, dtype=torch.bfloat16)]
    req = TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(Direction.D2H),
        block_ids=(3, 5),
        chunk_size=2 * bs,
        shape=ShapeDesc(
            kv_size=2, nl=nl, nb=nb, bs=bs, nh=nh, hs=hs, element_size=2, dtype="bfloat16"
        ),
    )
    caches = [PlanCache("cpu", 0, compiled=False), PlanCache("cpu", 0, compiled=True)]
    seen: list[list[tuple[int, int]]] = [[], []]
    for step in range(4):
        if step == 2:
            paged[1].mul_(2)  # a write: versions move
        if step == 3:
            paged[0] = paged[0].clone()  # another pointer
        for cache, log in zip(caches, seen, strict=True):
            cache.plan(req, paged, objs)
            log.append((cache.hits, cache.misses))
    assert seen[0] == seen[1] == [(0, 1), (1, 1), (1, 2), (1, 3)]


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVACTORS_HOTPATH", "yes")
    with pytest.raises(InvalidSettingError, match="KVACTORS_HOTPATH"):
        hotpath.load()
    monkeypatch.setenv("KVACTORS_HOTPATH", "0")
    assert hotpath.load() is None
    assert hotpath.status().startswith("python: off")
    with pytest.raises(InvalidSettingError, match="compiled=True"):
        PlanCache("cpu", 0, compiled=True)


def test_a_build_for_another_source_or_torch_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The build folder is named by the source, torch and Python: an empty cache (or one of
    another torch) has nothing to load, and ``KVACTORS_HOTPATH=1`` then refuses to go on."""
    monkeypatch.setenv("KVACTORS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hotpath, "_loaded", None)
    monkeypatch.delenv("KVACTORS_HOTPATH", raising=False)
    assert hotpath.load() is None
    assert "not built" in hotpath.status()
    assert hotpath.build_dir().is_relative_to(tmp_path)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    other = hotpath.build_dir()
    monkeypatch.undo()
    assert other != hotpath.build_dir()
    monkeypatch.setenv("KVACTORS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hotpath, "_loaded", None)
    monkeypatch.setenv("KVACTORS_HOTPATH", "1")
    with pytest.raises(MissingDependencyError, match="not built"):
        hotpath.load()


def test_rows_scatter_checks_everything_before_a_byte_moves(native: hotpath.Hotpath) -> None:
    """Row indices out of range, a chunk that does not hold the plan's rows, a device chunk:
    refused, and the paged memory is untouched."""
    paged = torch.zeros(8, 4)  # 8 rows of 4 elements
    chunk = torch.ones(2, 4)
    kernel = native.RowsScatter(8, 4, 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        kernel.bind(((0, torch.tensor([1, 8])),))
    bound = kernel.bind(((0, torch.tensor([1, 6])),))
    with pytest.raises(ValueError, match="rows"):
        bound([paged], [torch.ones(2, 2)])
    with pytest.raises(ValueError, match="host memory"):
        bound([paged], [torch.ones(2, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="host memory"):
        bound([torch.empty(8, 4, device="meta")], [chunk])
    with pytest.raises(TypeError, match="do not match"):
        bound([paged], [])
    assert not paged.any()
    bound([paged], [chunk])
    assert paged[[1, 6]].eq(1).all()
    assert int(paged.sum()) == 8


def test_stacked_gather_needs_its_block_ids(native: hotpath.Hotpath) -> None:
    pool = torch.arange(16.0).view(4, 4)
    out = torch.zeros(2, 4)
    unbound = native.StackedGather([4, 4], [4, 1], 0, 0, ((0, ([2, 4], [4, 1], 0)),))
    with pytest.raises(ValueError, match="bind"):
        unbound([pool], [out])
    with pytest.raises(ValueError, match="one id range per chunk"):
        unbound.bind((3, 1), ())
    unbound.bind((3, 1), ((0, 2),))([pool], [out])
    assert torch.equal(out, pool[[3, 1]])


def test_stacked_scatter_checks_before_a_byte_moves(native: hotpath.Hotpath) -> None:
    """Block ids out of range or device memory: refused, the paged memory untouched; a
    geometry without a contiguous run on both sides is not usable (numpy's scatter runs)."""
    pool = torch.zeros(4, 2, 8)  # [B, H, D], blocks on axis 0
    chunk = torch.ones(2, 2, 8)
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    unbound = native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, False)
    assert unbound.usable
    with pytest.raises(ValueError, match="out of range"):
        unbound.bind((1, 4), ((0, 2),))
    kernel = unbound.bind((3, 1), ((0, 2),))
    with pytest.raises(ValueError, match="host memory"):
        kernel([torch.empty(4, 2, 8, device="meta")], [chunk])
    with pytest.raises(ValueError, match="host memory"):
        kernel([pool], [chunk.double()])
    assert not pool.any()
    kernel([pool], [chunk])
    assert pool[[3, 1]].eq(1).all()
    assert int(pool.sum()) == 32
    assert not native.StackedRuns([4, 2, 8], [16, 8, 2], 0, 0, outs, False).usable  # strided run
    assert not native.StackedRuns([4, 1, 1], [16, 8, 1], 0, 0, outs, False).usable  # run = blocks


def test_stacked_runs_gather_into_the_chunk(native: hotpath.Hotpath) -> None:
    pool = torch.arange(64.0).view(4, 2, 8)  # [B, H, D]
    out = torch.zeros(2, 2, 8)
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, True).bind((3, 1), ((0, 2),))(
        [pool], [out]
    )
    assert torch.equal(out, pool[[3, 1]])


def _runs_case(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stacked pool [L, B, ...] (blocks on axis 1), a chunk's memory, and the chunk seen in
    the pool's axis order: its run spans S*H*D (NHD), H*D (a padded chunk) or D (HND)."""
    g = torch.Generator().manual_seed(7)
    if kind == "hnd":  # pool [L, B, H, S, D]; the chunk is [L, J, S, H, D] in memory
        pool = torch.randn(3, 6, 2, 4, 32, generator=g)
        memory = torch.zeros(3, 2, 4, 2, 32)
        return pool, memory, memory.permute(0, 1, 3, 2, 4)
    pool = torch.randn(3, 6, 4, 2, 32, generator=g)  # [L, B, S, H, D]
    if kind == "padded":  # each token's heads padded by one head in the chunk
        memory = torch.zeros(3, 2, 4, 3, 32)
        return pool, memory, memory[:, :, :, :2]
    memory = torch.zeros(3, 2, 4, 2, 32)
    return pool, memory, memory


@pytest.mark.parametrize("kind", ["nhd", "padded", "hnd"])
@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
def test_stacked_runs_merge_every_axis_contiguous_on_both_sides(
    native: hotpath.Hotpath, kind: str, to_chunk: bool
) -> None:
    """Runs span the inner axes contiguous in the pool and the chunk (up to S*H*D elements),
    never past an axis one side strides otherwise: every element lands where index_select
    and index_copy_ put it, and nothing else moves."""
    pool, memory, view = _runs_case(kind)
    ids = (5, 2)
    outs = ((0, (list(view.shape), list(view.stride()), view.storage_offset())),)
    unbound = native.StackedRuns(list(pool.shape), list(pool.stride()), 0, 1, outs, to_chunk)
    assert unbound.usable
    kernel = unbound.bind(ids, ((0, 2),))
    index = torch.tensor(ids)
    if to_chunk:
        kernel([pool], [memory])
        assert torch.equal(view, pool.index_select(1, index))
        if kind == "padded":
            assert not memory[:, :, :, 2].any()  # the padding stays untouched
    else:
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(3)))
        expected = pool.clone().index_copy_(1, index, view)
        kernel([pool], [memory])
        assert torch.equal(pool, expected)


@pytest.mark.parametrize("kind", ["StackedRuns", "StackedGather"])
def test_an_id_range_must_match_its_chunks_blocks(native: hotpath.Hotpath, kind: str) -> None:
    """A range of more or fewer ids than the chunk's view has blocks is refused at bind (the
    copy would read ids past the range's end)."""
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    if kind == "StackedRuns":
        unbound = native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, True)
    else:
        unbound = native.StackedGather([4, 2, 8], [16, 8, 1], 0, 0, outs)
    for ranges in (((0, 1),), ((0, 3),), ((0, 2), (0, 2))):
        with pytest.raises(ValueError, match=r"id range|one id range per chunk"):
            unbound.bind((3, 1, 2), ranges)
    unbound.bind((3, 1, 2), ((1, 3),))


def test_stacked_runs_stay_inside_each_storage(native: hotpath.Hotpath) -> None:
    """A paged tensor or a chunk too small for the kernel's views is refused before any
    byte moves (the kernel makes no view tensors: it checks the bounds itself)."""
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    kernel = native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, True).bind((3, 1), ((0, 2),))
    pool, chunk = torch.ones(4, 2, 8), torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="past its tensor's storage"):
        kernel([torch.ones(63)], [chunk])  # one element short of the paged view
    with pytest.raises(ValueError, match="past its tensor's storage"):
        kernel([pool], [torch.zeros(31)])  # one element short of the chunk's view
    assert not chunk.any()
    kernel([pool], [chunk])
    assert chunk.eq(1).all()


def _touched_in_python(
    ids: tuple[Any, ...], nb: int, start: int, stop: int, unique: bool
) -> frozenset[int] | None:
    """rebind_block_ids' Python checks of a one-segment plan, as a function."""
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= nb:
        return None
    moved = ids[start:stop]
    touched = frozenset(moved)
    return None if unique and len(touched) != len(moved) else touched


_ID_CASES: list[tuple[Any, ...]] = [
    (3, 1, 2),
    (0, 7),
    (7, 7, 2),  # a repeat
    (1, 1, 1, 1),
    (8, 1),  # past nb
    (-1, 2),
    (True, 2),  # a bool is not an exact int
    (2.0, 1),
    (1 << 70, 1),  # past int64
    (-(1 << 70), 1),
    (3, "1"),
    (5,),
]


@pytest.mark.parametrize("ids", _ID_CASES, ids=repr)
@pytest.mark.parametrize("span", [(0, 99), (1, 3), (0, 0), (2, 1), (-2, 99), (1, -1)])
@pytest.mark.parametrize("unique", [True, False])
def test_touched_blocks_answers_as_the_python_checks(
    native: hotpath.Hotpath, ids: tuple[Any, ...], span: tuple[int, int], unique: bool
) -> None:
    """Same answer, ``None`` or the same set, on ids of every kind and slices of every kind
    (past the end, empty, reversed, negative: as Python slices them)."""
    start, stop = span
    assert native.touched_blocks(ids, 8, start, stop, unique) == _touched_in_python(
        ids, 8, start, stop, unique
    )


def test_touched_blocks_refuses_malformed_arguments(native: hotpath.Hotpath) -> None:
    with pytest.raises(TypeError, match="tuple"):
        native.touched_blocks([1, 2], 8, 0, 2, False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="5 arguments"):
        native.touched_blocks((1, 2), 8, 0, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="2 arguments"):
        native.operand_key([torch.zeros(2)])  # type: ignore[call-arg]


def test_a_plan_cache_rebinds_as_the_python_checks(native: hotpath.Hotpath) -> None:
    """Other ids on a known geometry: the compiled checks rebind exactly the plans the Python
    checks rebind, refuse the same ids (full validation then raises its specific error), and
    give the same touched blocks."""
    from kvactors.errors import OperandTypeError, TransferValidationError
    from kvactors.layouts import Direction, KVFormat, ShapeDesc
    from kvactors.plans import TransferRequest

    nl, nb, bs, nh, hs = 2, 8, 4, 2, 8
    paged = list(torch.zeros(nl, 2, nb, bs, nh, hs).unbind(0))
    objs = [torch.zeros(2, nl, 2 * bs, nh * hs)]
    shape = ShapeDesc(kv_size=2, nl=nl, nb=nb, bs=bs, nh=nh, hs=hs, element_size=4, dtype="float32")
    caches = [PlanCache("cpu", 0, compiled=False), PlanCache("cpu", 0, compiled=True)]
    for direction in (Direction.D2H, Direction.H2D):
        for ids in [(3, 5), (5, 3), (0, 7), (6, 6), (8, 1), (1, True)]:
            req = TransferRequest(
                fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
                direction=int(direction),
                block_ids=ids,
                chunk_size=2 * bs,
                shape=shape,
            )
            answers: list[tuple[Any, ...]] = []
            for cache in caches:
                try:
                    plan = cache.plan(req, paged, objs)
                except (TransferValidationError, OperandTypeError) as exc:
                    answers.append(("refused", type(exc), cache.rebinds))
                else:
                    answers.append((plan.touched_blocks, plan.request.block_ids, cache.rebinds))
            assert answers[0] == answers[1], (direction, ids)
    assert caches[1].rebinds > 0


def test_a_binder_binds_the_kernel_bind_makes(native: hotpath.Hotpath) -> None:
    """``binder(ranges)(ids)`` copies what ``bind(ids, ranges)`` copies; the ranges are
    checked when the binder is made, the ids (a tuple) and their range at each bind."""
    pool = torch.arange(64.0).view(4, 2, 8)  # [B, H, D]
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    for unbound in (
        native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, True),
        native.StackedGather([4, 2, 8], [16, 8, 1], 0, 0, outs),
    ):
        with pytest.raises(ValueError, match="id range"):
            unbound.binder(((0, 3),))
        binder = unbound.binder(((1, 3),))
        with pytest.raises(TypeError, match="tuple"):
            binder([9, 3, 1])
        via_binder, via_bind = torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
        binder((9, 3, 1))([pool], [via_binder])
        unbound.bind((9, 3, 1), ((1, 3),))([pool], [via_bind])
        assert torch.equal(via_binder, pool[[3, 1]])
        assert torch.equal(via_bind, via_binder)


def test_a_bound_kernel_outlives_what_made_it(native: hotpath.Hotpath) -> None:
    """A kernel owns what it copies with (the geometry is shared, the ids its own): the
    unbound kernel and the binder may go first."""
    import gc

    pool = torch.arange(64.0).view(4, 2, 8)
    outs = ((0, ([2, 2, 8], [16, 8, 1], 0)),)
    binder = native.StackedRuns([4, 2, 8], [16, 8, 1], 0, 0, outs, True).binder(((0, 2),))
    kernel = binder((2, 0))
    del binder
    gc.collect()
    out = torch.zeros(2, 2, 8)
    kernel([pool], [out])
    assert torch.equal(out, pool[[2, 0]])
    with pytest.raises(TypeError, match="2 arguments"):
        kernel([pool])
