"""LMCache's own transfer paths as benchmark baselines for ``kvactors bench``.

kvactors never imports lmcache; its benchmarks find baselines through the entry-point group
``kvactors.baselines``. Each entry point returns a zero-argument callable making one
``multi_layer_block_kv_transfer`` call with LMCache's own argument types on exactly the
operands kvactors moves: LMCache's torch path (what MLU/MUSA users without kvactors run),
LMCache's own MLU and MUSA ops (on the fake vendors), and the ``kvactors_cpu`` plugin's op.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

__all__ = (
    "kvactors_op_transfer",
    "kvactors_vendor_op",
    "lmcache_mlu_ops",
    "lmcache_musa_ops",
    "lmcache_torch_transfer",
)

_OPS: list[Any] = []
_SHARED: dict[Any, Any] = {}


def _shared(key: Any, make: Callable[[], Any]) -> Any:
    # One ops instance per kind (and runtime) per process, shared by every caller thread, as
    # LMCache shares the ops it resolved.
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def _call(
    op: Callable[..., None],
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device | None = None,
    id_sets: Sequence[Sequence[int]] | None = None,
    object_sets: Sequence[Sequence[torch.Tensor]] | None = None,
) -> Callable[[], None]:
    # The arguments LMCache's engine-driven context passes (its native descriptor and
    # enums), built once; the callable makes the call only (the figure is the op's cost, not
    # the argument conversion). With ``id_sets`` each call takes the next set's block ids in
    # a new list, as LMCache's traffic brings other blocks on most calls; with
    # ``object_sets`` also the next set of chunk buffers (a store gathers into buffers its
    # host pool hands out).
    import torch
    from lmcache import lmcache_native as native

    sd = native.PageBufferShapeDesc()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(request.shape, f))
    sd.dtype = objects[0].dtype
    fmt = native.EngineKVFormat(int(request.fmt))
    direction = native.TransferDirection(int(request.direction))
    ids, objs = list(request.block_ids), list(objects)
    dev = torch.device("cpu") if device is None else device
    chunk, skip = request.chunk_size, request.skip_blocks

    if id_sets and object_sets:
        cycle = itertools.cycle([list(i) for i in id_sets])
        buffers = itertools.cycle([list(o) for o in object_sets])

        def fresh_buffers() -> None:
            op(paged, next(buffers), list(next(cycle)), dev, direction, sd, chunk, fmt, skip)

        return fresh_buffers
    if id_sets:
        cycle = itertools.cycle([list(i) for i in id_sets])

        def fresh() -> None:
            op(paged, objs, list(next(cycle)), dev, direction, sd, chunk, fmt, skip)

        return fresh

    def run() -> None:
        op(paged, objs, ids, dev, direction, sd, chunk, fmt, skip)

    return run


def lmcache_torch_transfer(
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    id_sets: Sequence[Sequence[int]] | None = None,
    object_sets: Sequence[Sequence[torch.Tensor]] | None = None,
) -> Callable[[], None]:
    """A zero-argument callable running LMCache's torch path for ``request`` on the operands
    (each call with the next of ``id_sets``' block ids when given, and the next of
    ``object_sets``' chunk buffers when given too)."""
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    return _call(
        multi_layer_block_kv_transfer,
        request,
        paged,
        objects,
        id_sets=id_sets,
        object_sets=object_sets,
    )


def _vendor_ops_transfer(
    module: str,
    cls: str,
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device,
    id_sets: Sequence[Sequence[int]] | None,
    record: bool,
) -> Callable[[], None]:
    import importlib

    from kvactors.errors import MissingDependencyError

    try:
        ops = _shared(cls, getattr(importlib.import_module(module), cls))
    except (ImportError, AttributeError) as exc:
        import lmcache

        raise MissingDependencyError(
            f"lmcache {getattr(lmcache, '__version__', '?')} has no {cls}", package="lmcache"
        ) from exc
    call = _call(ops.multi_layer_block_kv_transfer, request, paged, objects, device, id_sets)
    return _recording(ops, call, device) if record else call


def _recording(ops: Any, call: Callable[[], None], device: torch.device) -> Callable[[], None]:
    # The LMCache-driven path's pattern: each transfer followed by a completion record on
    # the caller's current stream (its native handle), drained by the caller here.
    import torch

    module = getattr(torch, device.type)
    attr = f"{device.type}_stream"
    record, drain = ops.record_completion_on_stream, ops.drain_recorded_completions

    def recorded() -> None:
        call()
        record(int(getattr(module.current_stream(), attr)), "finish", b"")
        drain()

    return recorded


def lmcache_mlu_ops(
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device,
    id_sets: Sequence[Sequence[int]] | None = None,
    *,
    record: bool = False,
) -> Callable[[], None]:
    """LMCache's own ``MluDeviceOps`` (lmcache >= 0.5.7) on the operands (each call with the
    next of ``id_sets``' block ids when given; with ``record`` each followed by a completion
    record on the current stream, then a drain); MissingDependencyError if absent."""
    return _vendor_ops_transfer(
        "lmcache.v1.platform.devices.mlu.device_ops", "MluDeviceOps", request, paged, objects,
        device, id_sets, record,
    )  # fmt: skip


def lmcache_musa_ops(
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device,
    id_sets: Sequence[Sequence[int]] | None = None,
    *,
    record: bool = False,
) -> Callable[[], None]:
    """LMCache's built-in ``MusaDeviceOps`` on the operands (the caller's current stream; each
    call with the next of ``id_sets``' block ids when given; ``record`` as for MLU)."""
    return _vendor_ops_transfer(
        "lmcache.v1.platform.devices.musa.device_ops", "MusaDeviceOps", request, paged, objects,
        device, id_sets, record,
    )  # fmt: skip


def kvactors_vendor_op(
    runtime: Runtime,
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device,
    id_sets: Sequence[Sequence[int]] | None = None,
    *,
    record: bool = False,
) -> Callable[[], None]:
    """The ``kvactors_mlu`` / ``kvactors_musa`` plugin's op (``KvactorsMluOps`` /
    ``KvactorsMusaOps``, as LMCache calls it: returns once the copies are enqueued on the
    caller's current stream) on ``runtime``, each call with the next of ``id_sets``' block
    ids when given (with ``record``, each followed by a completion record and a drain)."""
    from kvactors_lmcache.ops import ops_class_for

    def make() -> Any:
        return ops_class_for(device.type)(runtime_factory=lambda backend, index: runtime)

    ops = _shared((device.type, runtime), make)  # keeps the runtime: no id reused
    call = _call(ops.multi_layer_block_kv_transfer, request, paged, objects, device, id_sets)
    return _recording(ops, call, device) if record else call


def kvactors_op_transfer(
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    id_sets: Sequence[Sequence[int]] | None = None,
    object_sets: Sequence[Sequence[torch.Tensor]] | None = None,
) -> Callable[[], None]:
    """A zero-argument callable making LMCache's DeviceOps call of the ``kvactors_cpu`` plugin
    (``multi_layer_block_kv_transfer`` with LMCache's native argument types) for ``request``
    (each call with the next of ``id_sets``' block ids when given, and the next of
    ``object_sets``' chunk buffers when given too).

    One ops instance per process, shared by every caller, as LMCache shares its resolved ops.
    """
    from kvactors_lmcache.ops import KvactorsCpuOps

    if not _OPS:
        _OPS.append(KvactorsCpuOps())
    return _call(
        _OPS[0].multi_layer_block_kv_transfer,
        request,
        paged,
        objects,
        id_sets=id_sets,
        object_sets=object_sets,
    )
