"""The kvactors DeviceOps in-process: validation, threads, completions, pointers, MLU limits."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from ..conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
BPC = 2
CHUNK = BPC * BS


def _desc(dtype: torch.dtype = torch.bfloat16) -> Any:
    import lmcache.lmcache_native as native

    sd = native.PageBufferShapeDesc()
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 2, NL, NB, BS, NH, HS
    sd.element_size = torch.empty((), dtype=dtype).element_size()
    sd.dtype = dtype
    return sd


def _layers(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((2, NB, BS, NH, HS), generator=gen).to(dtype) for _ in range(NL)]


def _objs(n: int, dtype: torch.dtype = torch.bfloat16, fill: float = -1.0) -> list[torch.Tensor]:
    return [torch.full((2, NL, CHUNK, NH * HS), fill, dtype=dtype) for _ in range(n)]


def _native() -> Any:
    import lmcache.lmcache_native as native

    return native


@pytest.fixture
def cpu_ops() -> Any:
    from kvactors_lmcache.ops import KvactorsCpuOps

    return KvactorsCpuOps()


def _gather(ops: Any, layers: list[torch.Tensor], ids: list[int], objs: list[torch.Tensor]) -> None:
    n = _native()
    ops.multi_layer_block_kv_transfer(
        layers, objs, ids, torch.device("cpu"), n.TransferDirection.D2H, _desc(layers[0].dtype),
        CHUNK, n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
    )  # fmt: skip


def _oracle(layers: list[torch.Tensor], ids: list[int], objs: list[torch.Tensor]) -> None:
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    n = _native()
    multi_layer_block_kv_transfer(
        layers, objs, ids, torch.device("cpu"), n.TransferDirection.D2H, _desc(layers[0].dtype),
        CHUNK, n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
    )  # fmt: skip


def test_pointer_operands_are_refused_before_any_copy(cpu_ops: Any) -> None:
    layers = _layers(1)
    objs = _objs(2)
    with pytest.raises(TypeError, match="tensor operands only"):
        _gather(cpu_ops, layers, [0, 1, 2, 3], [o.data_ptr() for o in objs])  # type: ignore[misc]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    with pytest.raises(TypeError, match="packed pointer tensor"):
        _gather(cpu_ops, ptrs, [0, 1, 2, 3], objs)  # type: ignore[arg-type]
    assert all(bool((o == -1).all()) for o in objs)


@pytest.mark.parametrize(
    ("fmt", "chunk", "skip", "match"),
    [
        (5, CHUNK, 0, "engine_kv_format"),  # a format kvactors does not support
        (1, 6, 0, "multiple"),  # chunk not a multiple of bs
        (1, CHUNK, -1, "skip"),
    ],
)
def test_validation_errors_are_value_errors_and_touch_nothing(
    cpu_ops: Any, fmt: int, chunk: int, skip: int, match: str
) -> None:
    n = _native()
    layers, objs = _layers(2), _objs(2)
    with pytest.raises(ValueError, match=match):
        cpu_ops.multi_layer_block_kv_transfer(
            layers, objs, [0, 1, 2, 3], torch.device("cpu"), n.TransferDirection.D2H, _desc(),
            chunk, n.EngineKVFormat(fmt), skip,
        )  # fmt: skip
    assert all(bool((o == -1).all()) for o in objs)


def test_a_repeated_call_is_checked_as_the_first_one(cpu_ops: Any) -> None:
    # The ops reuse the request converted for equal arguments; what differs is checked anew.
    n = _native()
    layers = _layers(3)
    objs = _objs(2)
    ids = [0, 1, 2, 3]

    def call(chunk: Any = CHUNK, skip: Any = 0, sd: Any = None, block_ids: Any = ids) -> None:
        cpu_ops.multi_layer_block_kv_transfer(
            layers, objs, block_ids, torch.device("cpu"), n.TransferDirection.D2H,
            sd if sd is not None else _desc(), chunk, n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            skip,
        )  # fmt: skip

    call()
    want = [o.clone() for o in objs]
    for o in objs:
        o.fill_(-1)
    call()  # the reused request moves the same bytes
    assert all(torch.equal(a, b) for a, b in zip(objs, want, strict=True))
    with pytest.raises(TypeError, match="lmcache_chunk_size"):
        call(chunk=True if CHUNK == 1 else float(CHUNK))
    with pytest.raises(TypeError, match="skip_prefix_n_blocks"):
        call(skip=False)
    with pytest.raises(TypeError, match="block_ids"):
        call(block_ids=[0, 1, 2, "3"])
    with pytest.raises(ValueError, match="block"):
        call(block_ids=[0, 1, 2, NB])
    changed = _desc()
    changed.nb = NB // 2  # the same descriptor's values changed: converted and checked anew
    with pytest.raises(ValueError, match=r"needs \(2, 8, "):
        call(sd=changed)
    for o in objs:
        o.fill_(-1)
    call()
    assert all(torch.equal(a, b) for a, b in zip(objs, want, strict=True))


def test_wrong_device_type_is_refused(cpu_ops: Any) -> None:
    n = _native()
    with pytest.raises(TypeError, match="serves 'cpu'"):
        cpu_ops.multi_layer_block_kv_transfer(
            _layers(3), _objs(2), [0, 1, 2, 3], "mlu:0", n.TransferDirection.D2H, _desc(),
            CHUNK, n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
        )  # fmt: skip


@pytest.mark.timeout(60)
def test_four_threads_concurrently_bit_exact(cpu_ops: Any) -> None:
    from kvactors_lmcache.ops import transfer_counts

    before = transfer_counts().get("cpu:D2H", 0)
    errors: list[BaseException] = []
    mismatches: list[tuple[int, int]] = []
    barrier = threading.Barrier(4)

    def worker(tid: int) -> None:
        try:
            barrier.wait(timeout=10)
            for it in range(6):
                layers = _layers(100 * tid + it)
                ids = [(tid * 3 + it + k * 5) % NB for k in range(4)]
                got, ref = _objs(2), _objs(2)
                _gather(cpu_ops, layers, ids, got)  # complete on return
                _oracle(layers, ids, ref)
                if not all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)):
                    mismatches.append((tid, it))
        except BaseException as exc:  # report in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert not mismatches
    assert transfer_counts()["cpu:D2H"] - before == 24


def test_completions_drain_in_submission_order_as_bytes() -> None:
    from kvactors.runtime import get_runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    ops = KvactorsCpuOps()
    assert ops.drain_recorded_completions() == []  # no runtime started just to drain
    for i in range(5):
        ops.record_completion_on_stream(0, f"finish_{i}", bytearray(b"p%d" % i))  # type: ignore[arg-type]
    get_runtime("cpu").synchronize(0)  # a barrier behind the records: they are published
    got = ops.drain_recorded_completions()
    assert got == [(f"finish_{i}", b"p%d" % i) for i in range(5)]
    assert all(type(p) is bytes for _, p in got)
    assert ops.drain_recorded_completions() == []


def test_events_drain_in_order_with_lmcache_tuple_shape() -> None:
    from kvactors.runtime import get_runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    ops = KvactorsCpuOps()
    t0 = time.time()
    ops.record_event_on_stream(0, "mp.store.start", "s1", {"k": "v"}, {"n": 1})
    ops.record_event_on_stream(0, "mp.store.end", "s1", {}, {"n": 2})
    get_runtime("cpu").synchronize(0)  # a barrier behind the records: they are published
    got = ops.drain_recorded_events()
    assert [(e[0], e[1], e[3], e[4]) for e in got] == [
        ("mp.store.start", "s1", {"k": "v"}, {"n": 1}),
        ("mp.store.end", "s1", {}, {"n": 2}),
    ]
    assert all(isinstance(e[2], float) and e[2] >= t0 for e in got)


def test_cpu_tensor_from_ptr_writes_through(cpu_ops: Any) -> None:
    base = torch.zeros(16, dtype=torch.float32)
    view = cpu_ops.tensor_from_ptr(base.data_ptr(), (4, 4), torch.float32, torch.device("cpu"))
    view[1, 2] = 7.0
    assert base[6] == 7.0
    with pytest.raises(ValueError, match=r"(?i)pointer|ptr"):
        cpu_ops.tensor_from_ptr(0, (4,), torch.float32, torch.device("cpu"))


def test_cpu_memcpy_async_tensor_and_pointer_modes(cpu_ops: Any) -> None:
    n = _native()
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    cpu_ops.lmcache_memcpy_async(dst, src, 40, n.TransferDirection.H2D, 0, 16)
    assert torch.equal(dst[:40], src[:40])
    assert not dst[40:].any()
    # Pointer mode, D2H: "device" side src, host dest; split at 16-byte boundaries from 14.
    dst2 = torch.zeros(64, dtype=torch.uint8)
    cpu_ops.lmcache_memcpy_async(
        dst2.data_ptr(), src.data_ptr(), 37, n.TransferDirection.D2H, 14, 16
    )
    assert torch.equal(dst2[:37], src[:37])
    assert not dst2[37:].any()
    with pytest.raises(ValueError, match="power of two"):
        cpu_ops.lmcache_memcpy_async(dst, src, 4, n.TransferDirection.H2D, 0, 12)


def test_mlu_raw_pointer_entry_points_raise_clearly() -> None:
    from kvactors_lmcache.ops import KvactorsMluOps

    ops = KvactorsMluOps()
    with pytest.raises(NotImplementedError, match="tensor_from_ptr is not supported"):
        ops.tensor_from_ptr(1234, (4,), torch.float32, "mlu:0")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="LMCache-driven"):
        ops.lmcache_memcpy_async(1, 2, 4, 0, 0, 16)


class _RecordingRuntime:
    """Stands in for kvactors.runtime.Runtime to observe what the adapter passes."""

    def __init__(self, handle: int) -> None:
        self.calls: list[dict[str, Any]] = []
        self.completions: list[tuple[int, str, bytes]] = []
        handle_value = handle

        class _Backend:
            def current_stream_handle(self, index: int) -> int:
                return handle_value + index

        self.backend = _Backend()

    def transfer(
        self,
        request: Any,
        paged: Any,
        objects: Any,
        *,
        stream_handle: int = 0,
        complete: bool = True,
    ) -> None:
        self.calls.append(
            {
                "request": request,
                "paged": paged,
                "stream_handle": stream_handle,
                "complete": complete,
            }
        )

    def record_completion(self, handle: int, kind: str, payload: bytes) -> None:
        self.completions.append((handle, kind, payload))


def test_accelerator_ops_pass_the_calling_threads_current_stream() -> None:
    from kvactors_lmcache.ops import KvactorsMusaOps

    rts: dict[tuple[str, int], _RecordingRuntime] = {}

    def factory(backend: str, index: int) -> Any:
        return rts.setdefault((backend, index), _RecordingRuntime(0x5000))

    ops = KvactorsMusaOps(runtime_factory=factory)
    n = _native()
    ops.multi_layer_block_kv_transfer(
        _layers(4), _objs(2), [0, 1, 2, 3], "musa:1", n.TransferDirection.D2H, _desc(), CHUNK,
        n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
    )  # fmt: skip
    (call,) = rts[("musa", 1)].calls
    assert call["stream_handle"] == 0x5001
    assert call["complete"] is False  # returns once enqueued on the caller's stream
    KvactorsMusaOps(runtime_factory=factory, complete_on_return=True).multi_layer_block_kv_transfer(
        _layers(4), _objs(2), [0, 1, 2, 3], "musa:1", n.TransferDirection.D2H, _desc(), CHUNK,
        n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
    )  # fmt: skip
    assert rts[("musa", 1)].calls[1]["complete"] is True  # the caller's choice
    req = call["request"]
    assert (req.fmt, req.direction, req.block_ids, req.chunk_size) == (1, 1, (0, 1, 2, 3), CHUNK)
    assert req.shape.dtype == "bfloat16"


def test_handle_path_pointers_resolve_only_when_registered() -> None:
    from kvactors_lmcache.handle import REGISTRY
    from kvactors_lmcache.ops import KvactorsMusaOps

    rts: dict[tuple[str, int], _RecordingRuntime] = {}
    ops = KvactorsMusaOps(runtime_factory=lambda b, i: rts.setdefault((b, i), _RecordingRuntime(0)))  # type: ignore[arg-type, return-value]
    n = _native()
    k_layers, v_layers = _layers(5), _layers(6)
    k = [t[0] for t in k_layers]  # [NB, BS, NH, HS] views
    v = [t[1] for t in v_layers]
    temps = _objs(2)
    ptrs = torch.tensor([t.data_ptr() for t in k + v], dtype=torch.int64)
    args = (
        [0, 1, 2, 3], "musa:0", n.TransferDirection.D2H, _desc(), CHUNK,
        n.EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS, 0,
    )  # fmt: skip
    with pytest.raises(TypeError, match="not registered by a kvactors MUSA cache context"):
        ops.multi_layer_block_kv_transfer(ptrs, [t.data_ptr() for t in temps], *args)
    token = REGISTRY.register([*k, *v, *temps])
    try:
        ops.multi_layer_block_kv_transfer(ptrs, [t.data_ptr() for t in temps], *args)
    finally:
        REGISTRY.unregister(token)
    (call,) = rts[("musa", 0)].calls
    paged = call["paged"]
    assert [[t.data_ptr() for t in g] for g in paged] == [
        [t.data_ptr() for t in k],
        [t.data_ptr() for t in v],
    ]
    with pytest.raises(TypeError, match="not registered"):
        ops.multi_layer_block_kv_transfer(ptrs, [t.data_ptr() for t in temps], *args)
    REGISTRY.unregister(token)  # idempotent


def test_mlu_completion_published_only_after_stream_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync-then-publish through the runtime's StreamActor on a (fake, asynchronous) MLU.

    The host bytes are captured at the instant the record is published (a spy on the outbox's
    publish), not after a later barrier that would hide the order.
    """
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor
    from kvactors_lmcache.ops import KvactorsMluOps

    # Device work runs only once something waits for it: a record published before the
    # stream's sync sees the copy's destination untouched, every time.
    with fake_vendor("mlu", lazy=True) as fake_mlu:
        _completion_after_stream_work(fake_mlu, Runtime, KvactorsMluOps, monkeypatch)


def _completion_after_stream_work(
    fake_mlu: Any, runtime_cls: Any, ops_cls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvactors.actors.outbox import Outbox

    host = torch.zeros(256, dtype=torch.float32)  # pinned below, inside the fake
    at_publish: list[torch.Tensor] = []
    publish = Outbox.publish

    def spy(self: Any, seq: int, record: Any) -> None:
        at_publish.append(host.clone())
        publish(self, seq, record)

    monkeypatch.setattr(Outbox, "publish", spy)
    rt = runtime_cls("mlu", device_index=0).start()
    try:
        ops = ops_cls(runtime_factory=lambda b, i: rt)
        src = fake_mlu.to_device(torch.arange(256, dtype=torch.float32))
        stream = torch.mlu.current_stream()  # type: ignore[attr-defined]
        host = host.pin_memory()  # a pinned D2H stays asynchronous on the stream
        host.copy_(src, non_blocking=True)  # enqueued on the current stream
        handle = rt.backend.current_stream_handle(0)
        ops.record_completion_on_stream(handle, "finish_write", b"x")
        # A barrier queued behind the record on the same stream answers only after the
        # record's sync-then-publish ran: no polling needed.
        rt.synchronize(handle)
        got = ops.drain_recorded_completions()
        assert got == [("finish_write", b"x")]
        assert len(at_publish) == 1
        assert torch.equal(at_publish[0], torch.arange(256, dtype=torch.float32)), (
            "the record was published before the stream's copy ran"
        )
        stream.synchronize()
    finally:
        rt.close()


def test_a_refused_call_is_not_counted(cpu_ops: Any) -> None:
    """``transfer_counts`` counts transfers served: a call the runtime refuses leaves it as it
    was (the count is taken before the call and back when it raises)."""
    from kvactors_lmcache.ops import transfer_counts

    layers, objs = _layers(1), _objs(2)
    _gather(cpu_ops, layers, [0, 1, 2, 3], objs)
    before = transfer_counts().get("cpu:D2H", 0)
    with pytest.raises(ValueError, match="out of range"):
        _gather(cpu_ops, layers, [0, 1, 2, NB], objs)
    assert transfer_counts().get("cpu:D2H", 0) == before
    _gather(cpu_ops, layers, [4, 5, 6, 7], objs)
    assert transfer_counts()["cpu:D2H"] == before + 1


def test_handle_zero_records_on_the_current_device_after_a_switch() -> None:
    """Handle 0 is the default stream of the calling thread's current device, per call.

    Device work runs only once waited for (lazy fake). After the thread switches to device 1,
    a record on handle 0 must wait for device 1's default stream: syncing device 0 alone
    must not publish it, and it is drained once device 1 ran its work.
    """
    from kvactors.devices.mlu.backend import MluBackend
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor
    from kvactors_lmcache.ops import KvactorsMluOps

    with fake_vendor("mlu", lazy=True, devices=2) as fake:
        rts: dict[int, Runtime] = {}

        def factory(_kind: str, index: int) -> Runtime:
            return rts.setdefault(
                index, Runtime(MluBackend(layout_source="resolved"), device_index=index).start()
            )

        try:
            ops = KvactorsMluOps(runtime_factory=factory)
            torch.mlu.set_device(0)  # type: ignore[attr-defined]
            ops.record_completion_on_stream(0, "warm", b"0")
            factory("mlu", 0).synchronize(0)
            assert ops.drain_recorded_completions() == [("warm", b"0")]
            torch.mlu.set_device(1)  # type: ignore[attr-defined]
            x = fake.to_device(torch.zeros(4), index=1)
            x.fill_(7.0)  # queued on device 1's default stream, not run yet
            ops.record_completion_on_stream(0, "store", b"1")
            rts[0].synchronize(0)  # device 0's default stream: not the one the record names
            early = ops.drain_recorded_completions()
            ran = bool((fake.peek(x) == 7.0).all())
            assert not early or ran, "published before device 1's default stream ran"
            factory("mlu", 1).synchronize(0)
            got = early + ops.drain_recorded_completions()
            assert got == [("store", b"1")]
            assert bool((fake.peek(x) == 7.0).all())
        finally:
            for rt in rts.values():
                rt.close()
