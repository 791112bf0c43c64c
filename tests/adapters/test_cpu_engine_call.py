"""The op's one-frame path for vLLM's repeated CPU call, against the full conversion.

The engine repeats every argument but the block ids and the chunks. Once a request was
converted for those arguments, such a call is served in the op's own frame: the same
``Runtime.transfer`` arguments as the full conversion's, the same refusals (type, message,
field) before anything is copied, and every other call shape left to the full conversion.
On MLU and MUSA the same path follows the calling thread's current device and stream.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

if TYPE_CHECKING:
    import types
    from collections.abc import Callable

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

torch.set_num_threads(1)

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
CHUNK = 2 * BS


def _native() -> Any:
    import lmcache.lmcache_native as native

    return native


def _desc() -> Any:
    sd = _native().PageBufferShapeDesc()
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 2, NL, NB, BS, NH, HS
    sd.element_size, sd.dtype = 2, torch.bfloat16
    return sd


def _layers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((2, NB, BS, NH, HS), generator=gen).to(torch.bfloat16) for _ in range(NL)]


def _objs(n: int = 2) -> list[torch.Tensor]:
    return [torch.full((2, NL, CHUNK, NH * HS), -1.0, dtype=torch.bfloat16) for _ in range(n)]


def _args(layers: Any, objs: Any, ids: Any, **over: Any) -> dict[str, Any]:
    n = _native()
    args: dict[str, Any] = {
        "paged_buffer_ptrs_tensor": layers,
        "lmcache_objects_ptrs": objs,
        "block_ids": ids,
        "device": torch.device("cpu"),
        "direction": n.TransferDirection.D2H,
        "shape_desc": _desc(),
        "lmcache_chunk_size": CHUNK,
        "engine_kv_format": n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
        "skip_prefix_n_blocks": 0,
    }
    args.update(over)
    return args


def _in_full(ops: Any, **args: Any) -> None:
    """The op with its converted requests forgotten: every argument converted and checked."""
    ops._requests.clear()
    ops.multi_layer_block_kv_transfer(**args)


class _Recorder:
    """A runtime stand-in that records each ``transfer`` call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def transfer(
        self, request: Any, paged: Any, objects: Any, *, stream_handle: int, complete: bool
    ) -> None:
        self.calls.append((request, paged, objects, stream_handle, complete))


def _adapter_frames(fn: Callable[[], None]) -> int:
    """Python frames ``fn()`` makes in the adapter package's own files."""
    import kvactors_lmcache

    adapter_dir = os.path.dirname(kvactors_lmcache.__file__ or "") + os.sep
    frames = [0]

    def prof(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(adapter_dir):
            frames[0] += 1

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(old)
    return frames[0]


def test_the_repeated_engine_call_is_one_frame_with_the_full_conversions_arguments() -> None:
    from kvactors_lmcache.ops import KvactorsCpuOps

    rec = _Recorder()
    ops = KvactorsCpuOps(runtime_factory=lambda _b, _i: rec)  # type: ignore[arg-type,return-value]
    layers, objs = _layers(1), _objs()
    ops.multi_layer_block_kv_transfer(**_args(layers, objs, [0, 1, 2, 3]))  # converts
    other = _objs()
    frames = _adapter_frames(
        lambda: ops.multi_layer_block_kv_transfer(**_args(layers, other, [7, 5, 3, 1]))
    )
    assert frames == 1, f"the engine's repeated call made {frames} adapter frames"
    # The base op, for the same call: the same arguments reach the runtime.
    _in_full(ops, **_args(layers, other, [7, 5, 3, 1]))
    fast, base = rec.calls[1], rec.calls[2]
    assert fast[0] == base[0]
    assert fast[0].block_ids == (7, 5, 3, 1)
    assert fast[1] is layers
    assert fast[2] is other
    assert fast[3:] == base[3:] == (0, True)
    first = rec.calls[0][0]
    for name in first.__struct_fields__:
        if name != "block_ids":
            assert getattr(fast[0], name) == getattr(first, name), name


class _LayerTensor(torch.Tensor):
    """A tensor subclass, as a vendor's (or the fake vendor's) device tensor may be."""


def test_layers_of_a_tensor_subclass_take_the_one_frame_path_once_converted() -> None:
    """The full conversion accepts layers of a tensor subclass as tensors; from then on the
    engine's repeated call with such layers is the one-frame path, with the same request."""
    from kvactors_lmcache.ops import KvactorsCpuOps

    rec = _Recorder()
    ops = KvactorsCpuOps(runtime_factory=lambda _b, _i: rec)  # type: ignore[arg-type,return-value]
    layers = [t.as_subclass(_LayerTensor) for t in _layers(1)]
    objs = _objs()
    first = _adapter_frames(
        lambda: ops.multi_layer_block_kv_transfer(**_args(layers, objs, [0, 1, 2, 3]))
    )
    assert first > 1  # converted in full: the subclass was not known
    other = _objs()
    frames = _adapter_frames(
        lambda: ops.multi_layer_block_kv_transfer(**_args(layers, other, [7, 5, 3, 1]))
    )
    assert frames == 1, f"the repeated call made {frames} adapter frames"
    _in_full(ops, **_args(layers, other, [7, 5, 3, 1]))
    fast, base = rec.calls[1], rec.calls[2]
    assert fast[0] == base[0]
    assert fast[1] is layers


def _bad_calls() -> dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], dict[str, Any]]]:
    n = _native()
    no_dtype = n.PageBufferShapeDesc()
    no_dtype.kv_size, no_dtype.nl, no_dtype.nb, no_dtype.bs = 2, NL, NB // 2, BS
    no_dtype.nh, no_dtype.hs, no_dtype.element_size = NH, HS, 2
    changed = _desc()
    changed.nb = NB // 2
    return {
        "str id": lambda L, o: _args(L, o, [0, 1, 2, "3"]),
        "bool id": lambda L, o: _args(L, o, [0, True, 2, 3]),
        "id out of range": lambda L, o: _args(L, o, [0, 1, 2, NB]),
        "duplicate id to scatter": lambda L, o: _args(
            L, o, [0, 1, 1, 3], direction=n.TransferDirection.H2D
        ),
        "float chunk": lambda L, o: _args(L, o, [0, 1, 2, 3], lmcache_chunk_size=float(CHUNK)),
        "bool skip": lambda L, o: _args(L, o, [0, 1, 2, 3], skip_prefix_n_blocks=False),
        "negative skip": lambda L, o: _args(L, o, [0, 1, 2, 3], skip_prefix_n_blocks=-1),
        "other device type": lambda L, o: _args(L, o, [0, 1, 2, 3], device=torch.device("meta")),
        "device string": lambda L, o: _args(L, o, [0, 1, 2, 3], device="mlu:0"),
        "pointer chunks": lambda L, o: _args(L, [t.data_ptr() for t in o], [0, 1, 2, 3]),
        "packed pointers": lambda L, o: _args(
            torch.tensor([t.data_ptr() for t in L], dtype=torch.int64), o, [0, 1, 2, 3]
        ),
        "pointer layers": lambda L, o: _args([t.data_ptr() for t in L], o, [0, 1, 2, 3]),
        "mixed chunks": lambda L, o: _args(L, [o[0], o[1].data_ptr()], [0, 1, 2, 3]),
        "layerwise": lambda L, o: {**_args(L, o, [0, 1, 2, 3]), "layerwise": True},
        "layerwise int": lambda L, o: {**_args(L, o, [0, 1, 2, 3]), "layerwise": 0},
        "changed descriptor": lambda L, o: _args(L, o, [0, 1, 2, 3], shape_desc=changed),
        "descriptor without dtype": lambda L, o: _args(L, o, [0, 1, 2, 3], shape_desc=no_dtype),
        "other dtype": lambda L, o: _args([t.half() for t in L], [t.half() for t in o], [0, 1]),
        "chunk too small": lambda L, o: _args(L, [t[:, :, :BS] for t in o], [0, 1, 2, 3]),
        "unknown format": lambda L, o: _args(
            L, o, [0, 1, 2, 3], engine_kv_format=n.EngineKVFormat(5)
        ),
    }


BAD = sorted(_bad_calls())


def _raised(fn: Callable[[], None]) -> tuple[type[BaseException], str, object]:
    with pytest.raises(BaseException) as info:  # noqa: PT011 - compared field by field below
        fn()
    return info.type, str(info.value), getattr(info.value, "field", None)


@pytest.mark.parametrize("case", BAD)
def test_a_refused_call_after_the_engines_call_is_refused_as_in_full(case: str) -> None:
    """After the engine's call converted its request, a call that differs in one thing raises
    what the full conversion raises for it (type, message, field), and copies nothing."""
    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    rt = Runtime("cpu").start()
    try:
        ops = KvactorsCpuOps(runtime_factory=lambda _b, _i: rt)
        layers = _layers(2)
        ops.multi_layer_block_kv_transfer(**_args(layers, _objs(), [0, 1, 2, 3]))
        make = _bad_calls()[case]
        before = [t.clone() for t in layers]
        objs = _objs()
        got = _raised(lambda: ops.multi_layer_block_kv_transfer(**make(layers, objs)))
        base_objs = _objs()
        want = _raised(lambda: _in_full(ops, **make(layers, base_objs)))
        assert got == want
        assert issubclass(got[0], (TypeError, ValueError, NotImplementedError))
        assert all(bool((o == -1).all()) for o in objs + base_objs), "a refused call copied"
        assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))
    finally:
        rt.close()


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(lambda: torch.tensor([9, 4, 2, 12]), id="tensor"),
        pytest.param(lambda: (9, 4, 2, 12), id="tuple"),
    ],
)
def test_other_call_shapes_move_what_the_full_conversion_moves(ids: Callable[[], Any]) -> None:
    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    rt = Runtime("cpu").start()
    try:
        ops = KvactorsCpuOps(runtime_factory=lambda _b, _i: rt)
        layers = _layers(3)
        ops.multi_layer_block_kv_transfer(**_args(layers, _objs(), [0, 1, 2, 3]))
        got, want = _objs(), _objs()
        ops.multi_layer_block_kv_transfer(**_args(layers, got, ids()))
        _in_full(ops, **_args(layers, want, [9, 4, 2, 12]))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert not all(bool((o == -1).all()) for o in got)
    finally:
        rt.close()


def _outcome(rec: _Recorder, fn: Callable[[], None]) -> tuple[object, ...]:
    """What ``fn()`` raised (type, message, field), and what reached the runtime."""
    del rec.calls[:]
    try:
        fn()
    except Exception as exc:  # the outcome, compared below
        raised: tuple[object, ...] = (type(exc), str(exc), getattr(exc, "field", None))
    else:
        raised = ()
    return raised, [(c[0], c[3], c[4]) for c in rec.calls]


@pytest.mark.parametrize("case", BAD)
def test_the_adapter_refuses_what_the_full_conversion_refuses_before_the_runtime(case: str) -> None:
    """Against a runtime that accepts anything: the adapter's own checks on the one-frame path
    are the full conversion's (what it refuses never reaches the runtime, and what it passes
    on is passed on alike)."""
    from kvactors_lmcache.ops import KvactorsCpuOps

    rec = _Recorder()
    ops = KvactorsCpuOps(runtime_factory=lambda _b, _i: rec)  # type: ignore[arg-type,return-value]
    layers = _layers(4)
    ops.multi_layer_block_kv_transfer(**_args(layers, _objs(), [0, 1, 2, 3]))
    make = _bad_calls()[case]
    got = _outcome(rec, lambda: ops.multi_layer_block_kv_transfer(**make(layers, _objs())))
    want = _outcome(rec, lambda: _in_full(ops, **make(layers, _objs())))
    assert got == want


class _StreamRecorder(_Recorder):
    """A recording runtime whose backend answers a new stream handle on every ask."""

    def __init__(self, index: int) -> None:
        super().__init__()
        asked = self.asked = []  # type: list[int]

        class _Backend:
            def current_stream_handle(self, device_index: int) -> int:
                asked.append(device_index)
                return 0x1000 * len(asked) + device_index

        self.backend = _Backend()
        self.index = index


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_the_repeated_call_on_an_accelerator_follows_the_current_device_and_stream(
    kind: str,
) -> None:
    """On MLU and MUSA the engine's repeated call (a ``torch.device`` without an index) goes to
    the calling thread's current device, with that device's current stream asked on this
    call, as the full conversion does; in a few adapter frames."""
    from kvactors.testing import fake_vendor
    from kvactors.testing.pytest_plugin import require_torch_devices
    from kvactors_lmcache.ops import ops_class_for

    require_torch_devices(kind)
    with fake_vendor(kind, devices=2):
        rts: dict[int, _StreamRecorder] = {}
        ops = ops_class_for(kind)(
            runtime_factory=lambda _b, i: rts.setdefault(i, _StreamRecorder(i))  # type: ignore[arg-type,return-value]
        )
        mod = getattr(torch, kind)
        layers = _layers(5)
        dev = torch.device(kind)
        mod.set_device(0)
        ops.multi_layer_block_kv_transfer(**_args(layers, _objs(), [0, 1, 2, 3], device=dev))
        mod.set_device(1)
        ops.multi_layer_block_kv_transfer(**_args(layers, _objs(), [4, 5], device=dev))
        other = _objs()
        frames = _adapter_frames(
            lambda: ops.multi_layer_block_kv_transfer(**_args(layers, other, [6, 7], device=dev))
        )
        _in_full(ops, **_args(layers, other, [6, 7], device=dev))
        assert [len(rts[0].calls), len(rts[1].calls)] == [1, 3]
        assert rts[1].calls[0][0].block_ids == (4, 5)
        _, fast, full = rts[1].calls
        assert fast[0] == full[0]
        assert fast[0].block_ids == (6, 7)
        assert fast[2] is other
        assert rts[1].asked == [1, 1, 1]  # the current stream, asked on each call
        assert (fast[3], full[3]) == (0x2001, 0x3001)
        assert fast[4] is full[4] is False  # returns once enqueued on the caller's stream
        # The op, the current device and the current stream's handle (MUSA: its pointer check).
        assert frames <= (4 if kind == "musa" else 3), frames
