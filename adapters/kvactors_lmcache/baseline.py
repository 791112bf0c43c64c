"""LMCache's own torch transfer path as a benchmark baseline for ``kvactors bench``.

kvactors never imports lmcache; its benchmarks find baselines through the entry-point group
``kvactors.baselines``. This one runs LMCache's
``lmcache.v1.platform.torch_ops.multi_layer_block_kv_transfer`` (the path MLU/MUSA users run
today) on exactly the operands kvactors moves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from kvactors.plans import TransferRequest

__all__ = ("lmcache_mlu_ops", "lmcache_musa_ops", "lmcache_torch_transfer")


def lmcache_torch_transfer(
    request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
) -> Callable[[], None]:
    """A zero-argument callable running LMCache's torch path for ``request`` on the operands."""
    import torch
    from lmcache import lmcache_native as native
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    shape = request.shape
    sd = native.PageBufferShapeDesc()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(shape, f))
    sd.dtype = objects[0].dtype
    fmt = native.EngineKVFormat(int(request.fmt))
    direction = native.TransferDirection(int(request.direction))
    ids, cpu = list(request.block_ids), torch.device("cpu")
    objs = list(objects)

    def run() -> None:
        multi_layer_block_kv_transfer(
            paged, objs, ids, cpu, direction, sd, request.chunk_size, fmt, request.skip_blocks
        )

    return run


def _vendor_ops_transfer(
    module: str,
    cls: str,
    request: TransferRequest,
    paged: Any,
    objects: Sequence[torch.Tensor],
    device: torch.device,
) -> Callable[[], None]:
    import importlib

    from lmcache import lmcache_native as native

    from kvactors.errors import MissingDependencyError

    try:
        ops = getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        import lmcache

        raise MissingDependencyError(
            f"lmcache {getattr(lmcache, '__version__', '?')} has no {cls}", package="lmcache"
        ) from exc
    shape = request.shape
    sd = native.PageBufferShapeDesc()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(shape, f))
    sd.dtype = objects[0].dtype
    fmt = native.EngineKVFormat(int(request.fmt))
    direction = native.TransferDirection(int(request.direction))
    ids, objs = list(request.block_ids), list(objects)

    def run() -> None:
        ops.multi_layer_block_kv_transfer(
            paged, objs, ids, device, direction, sd, request.chunk_size, fmt, request.skip_blocks
        )

    return run


def lmcache_mlu_ops(
    request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor], device: torch.device
) -> Callable[[], None]:
    """LMCache's own ``MluDeviceOps`` (lmcache >= 0.5.7) on the operands; ImportError if absent."""
    return _vendor_ops_transfer(
        "lmcache.v1.platform.devices.mlu.device_ops",
        "MluDeviceOps",
        request,
        paged,
        objects,
        device,
    )


def lmcache_musa_ops(
    request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor], device: torch.device
) -> Callable[[], None]:
    """LMCache's built-in ``MusaDeviceOps`` on the operands (the caller's current stream)."""
    return _vendor_ops_transfer(
        "lmcache.v1.platform.devices.musa.device_ops",
        "MusaDeviceOps",
        request,
        paged,
        objects,
        device,
    )


_OPS: list[Any] = []


def kvactors_op_transfer(
    request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
) -> Callable[[], None]:
    """A zero-argument callable making LMCache's DeviceOps call of the ``kvactors_cpu`` plugin
    (``multi_layer_block_kv_transfer`` with LMCache's native argument types) for ``request``.

    One ops instance per process, shared by every caller, as LMCache shares its resolved ops.
    """
    import torch
    from lmcache import lmcache_native as native

    from kvactors_lmcache.ops import KvactorsCpuOps

    if not _OPS:
        _OPS.append(KvactorsCpuOps())
    ops = _OPS[0]
    shape = request.shape
    sd = native.PageBufferShapeDesc()
    for f in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems"):
        setattr(sd, f, getattr(shape, f))
    sd.dtype = objects[0].dtype
    fmt = native.EngineKVFormat(int(request.fmt))
    direction = native.TransferDirection(int(request.direction))
    ids, cpu = list(request.block_ids), torch.device("cpu")
    objs = list(objects)

    def run() -> None:
        ops.multi_layer_block_kv_transfer(
            paged, objs, ids, cpu, direction, sd, request.chunk_size, fmt, request.skip_blocks
        )

    return run
