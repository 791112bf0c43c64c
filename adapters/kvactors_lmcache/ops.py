"""LMCache ``DeviceOps`` subclasses that route transfers into the kvactors runtime.

Each ``multi_layer_block_kv_transfer`` (from any LMCache thread) is converted into a
:class:`kvactors.core.plans.TransferRequest` for the process-wide runtime of its device. On
accelerators the caller's current stream handle goes with it and the call returns once the
copies are enqueued on that stream, as LMCache's own MLU/MUSA ops do
(``complete_on_return=True`` or ``KVACTORS_LMCACHE_COMPLETE_ON_RETURN=1`` waits instead); on
CPU it is complete on return. Operands are tensors; raw pointers are a ``TypeError``, except
on MUSA for the device pointers a kvactors cache context registered (the handle path,
:mod:`kvactors_lmcache.handle`). Completions and events are published sync-then-publish by
the runtime's StreamActor.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec
import torch
from lmcache.v1.platform.base.device_ops import DeviceOps

from kvactors.errors import (
    InvalidPointerError,
    InvalidSettingError,
    OperandTypeError,
    TransferValidationError,
    UnsupportedOperationError,
)
from kvactors.observe import mirror as metrics_mirror
from kvactors_lmcache import convert

if TYPE_CHECKING:
    from kvactors.core.plans import TransferRequest
    from kvactors.runtime import Runtime

__all__ = (
    "DELIBERATELY_INHERITED",
    "REMOVED_IN_LMCACHE_057",
    "KvactorsCpuOps",
    "KvactorsDeviceOps",
    "KvactorsMluOps",
    "KvactorsMusaOps",
    "RuntimeFactory",
    "ops_class_for",
    "transfer_counts",
)

RuntimeFactory = Callable[[str, int], "Runtime"]

_REQUESTS_KEPT = 64  # converted requests kept per ops instance (one per pool and direction)

# Every public DeviceOps member of lmcache 0.5.6 and 0.5.7 that the kvactors ops do NOT
# override, with the reason. tests/adapters/test_lmcache_contract.py walks the installed class
# and fails on any public member that is neither overridden nor listed here, and on any listed
# name the installed class lacks (unless LMCache removed it: REMOVED_IN_LMCACHE_057).
DELIBERATELY_INHERITED: dict[str, str] = {
    # Shared types: LMCache's own descriptor (read field by field by convert.shape_desc_of)
    # and plan classes.
    "PageBufferShapeDesc": "LMCache's descriptor class, read by convert.shape_desc_of",
    "StagingCopy": "LMCache plan type, only used by native object-group transfers",
    "LaunchVar": "LMCache plan type, only used by native object-group transfers",
    "BatchStep": "LMCache plan type, only used by native object-group transfers",
    "KernelGroupSpec": "LMCache plan type, only used by native object-group transfers",
    "device_type": "ClassVar, overridden per subclass as a class attribute",
    "ensure_native": "no native extension: kvactors is the implementation (no bind_native)",
    "bind_native": "never called: rebinding would drop the Tensor annotation (pointer mode)",
    # Host memory management: server-side L1 allocators; CPU memory, not a device concern.
    "alloc_hugepage_pinned_numa_ptr": "server L1 host allocator (torch baseline)",
    "alloc_hugepage_pinned_ptr": "server L1 host allocator (torch baseline)",
    "alloc_numa_ptr": "server L1 host allocator (torch baseline)",
    "alloc_pinned_numa_ptr": "server L1 host allocator (torch baseline)",
    "alloc_pinned_ptr": "server L1 host allocator (torch baseline)",
    "alloc_shm_pinned_ptr": "server L1 host allocator (torch baseline)",
    "free_hugepage_pinned_numa_ptr": "server L1 host allocator (torch baseline)",
    "free_hugepage_pinned_ptr": "server L1 host allocator (torch baseline)",
    "free_numa_ptr": "server L1 host allocator (torch baseline)",
    "free_pinned_numa_ptr": "server L1 host allocator (torch baseline)",
    "free_pinned_ptr": "server L1 host allocator (torch baseline)",
    "free_shm_pinned_ptr": "server L1 host allocator (torch baseline)",
    "batched_memcpy": "host-to-host pointer copies of the L1 allocator (torch baseline)",
    "get_gpu_pci_bus_id": "NUMA placement hint; the torch baseline answers without CUDA",
    # Non-MP (in-process connector) transfer and reshape ops: not on the MP path kvactors
    # serves; the torch baseline keeps working for CPU and MUSA tensors. KvactorsMluOps
    # refuses them (LEGACY_CONNECTOR_OPS), as LMCache's own MLU ops do.
    "multi_layer_kv_transfer": "non-MP vLLM connector op, not on the MP path",
    "multi_layer_kv_transfer_unilateral": "non-MP vLLM connector op, not on the MP path",
    "single_layer_kv_transfer": "non-MP vLLM connector op, not on the MP path",
    "single_layer_kv_transfer_sgl": "non-MP SGLang connector op, not on the MP path",
    "load_and_reshape_flash": "non-MP vLLM connector op, not on the MP path",
    "reshape_and_cache_back_flash": "non-MP vLLM connector op, not on the MP path",
    "rotary_embedding_k_fused": "CacheBlend positional op, compute not transfer",
    "rotary_embedding_k_fused_strided": "CacheBlend positional op, compute not transfer",
    # CacheGen codec: compute kernels, not transfers.
    "calculate_cdf": "CacheGen codec kernel, compute not transfer",
    "decode_fast_new": "CacheGen codec kernel, compute not transfer",
    "decode_fast_prefsum": "CacheGen codec kernel, compute not transfer",
    "encode_fast_new": "CacheGen codec kernel, compute not transfer",
}

REMOVED_IN_LMCACHE_057: frozenset[str] = frozenset(
    {"multi_layer_kv_transfer_unilateral", "single_layer_kv_transfer_sgl"}
)
"""DeviceOps members of 0.5.6 that 0.5.7 removed (no 0.5.7 caller; inherited on 0.5.6 only)."""

# Per calling thread, a dict that only that thread writes (a count without a lock: the
# transfer call pays no lock, and no update is lost); the registry keeps every thread's dict,
# also after the thread ended.
_counts_lock = threading.Lock()
_thread_counts: list[dict[str, int]] = []
_tls = threading.local()


def _my_counts() -> dict[str, int]:
    mine: dict[str, int] = {}
    with _counts_lock:
        _thread_counts.append(mine)
    _tls.counts = mine
    return mine


def transfer_counts() -> dict[str, int]:
    """Transfers served by the kvactors ops in this process, keyed ``"<backend>:<H2D|D2H>"``."""
    with _counts_lock:
        dicts = list(_thread_counts)
    total: Counter[str] = Counter()
    for counts in dicts:
        total.update(dict(counts))  # one C call: the owner's writes never interleave with it
    return dict(total)


# The operand types of the engine's call, compared as sets of element types.
_TENSOR_TYPE = {torch.Tensor}
# Layer tensor types a full conversion took (torch.Tensor, and subclasses such as a fake
# vendor's device tensor, learned once): the one-frame path checks layers against them.
_LAYER_TENSORS: set[type] = {torch.Tensor}
_LIST_TYPE = {list}
_INT_TYPE = {int}


def _default_runtime_factory(backend: str, device_index: int) -> Runtime:
    from kvactors.runtime import get_runtime

    if backend == "mlu":
        from kvactors.devices.mlu import MluBackend

        return get_runtime(MluBackend(layout_source=mlu_layout_source()), device_index)
    return get_runtime(backend=backend, device_index=device_index)


def mlu_layout_source() -> Literal["resolved"] | None:
    """Where format 1 (NHD) reaching the MLU plugin comes from, when the worker did not say.

    ``KVACTORS_MLU_LAYOUT_SOURCE`` wins (``None`` here lets the backend read it). Otherwise:
    LMCache 0.5.7 (the release that ships its own MLU backend, ``lmcache.v1.platform.devices.mlu``)
    maps vLLM-MLU's legacy layout answer to HND itself, so format 1 is an explicitly resolved
    NHD: ``"resolved"``. LMCache 0.5.6 passes the legacy answer through, so format 1 stays
    ambiguous and is refused until the worker declares it (``None``).
    """
    from kvactors.devices.mlu.layouts import LAYOUT_SOURCE_ENV

    if os.environ.get(LAYOUT_SOURCE_ENV, "").strip():
        return None
    try:
        own_mlu = importlib.util.find_spec("lmcache.v1.platform.devices.mlu") is not None
    except (ImportError, ValueError):
        own_mlu = False
    return "resolved" if own_mlu else None


class KvactorsDeviceOps(DeviceOps):
    """The kvactors-backed op surface shared by the CPU, MLU and MUSA plugins.

    Args:
        runtime_factory: ``(backend, device_index) -> Runtime``; defaults to
            ``kvactors.runtime.get_runtime`` (process-wide, started lazily).
    """

    device_type: ClassVar[str] = ""
    kvactors_backend: ClassVar[str] = ""
    #: Whether transfers carry the caller's current stream (accelerators) or handle 0.
    uses_streams: ClassVar[bool] = True

    def __init__(
        self,
        *,
        runtime_factory: RuntimeFactory | None = None,
        complete_on_return: bool | None = None,
    ) -> None:
        super().__init__()
        if complete_on_return is None:
            complete_on_return = (not self.uses_streams) or os.environ.get(
                "KVACTORS_LMCACHE_COMPLETE_ON_RETURN", ""
            ).strip().lower() in ("1", "true", "yes", "on")
        #: Whether a transfer returns only once the device completed it (always on CPU).
        self.complete_on_return = complete_on_return
        self._runtime_factory = runtime_factory or _default_runtime_factory
        self._lock = threading.Lock()
        self._runtimes: dict[int, Runtime] = {}
        self._count_keys = (f"{self.kvactors_backend}:H2D", f"{self.kvactors_backend}:D2H")
        self._requests: dict[tuple[Any, ...], TransferRequest] = {}

    # -- runtime plumbing ---------------------------------------------------------------

    def _runtime(self, index: int) -> Runtime:
        with self._lock:
            rt = self._runtimes.get(index)
            if rt is None:
                rt = self._runtime_factory(self.kvactors_backend, index)
                self._runtimes[index] = rt
                # Mirrored into prometheus_client from a background thread (in the process
                # that moves KV: LMCache makes these ops in every process that imports it);
                # never raises, whatever the metrics setting.
                metrics_mirror.watch(rt)
            return rt

    def _current_index(self) -> int:
        if not self.uses_streams:
            return 0
        mod = getattr(torch, self.kvactors_backend, None)
        current = getattr(mod, "current_device", None)
        if callable(current):
            return int(current())
        return 0

    def _device_index(self, device: object) -> int:
        # Duck-typed: torch.device, vendor/fake device objects (``type``/``index``) or a
        # "kind[:index]" string (torch.device("mlu") only parses once torch_mlu is imported).
        if isinstance(device, str):
            kind, _, idx = device.partition(":")
            index: int | None = int(idx) if idx.isdigit() else None
            if idx and index is None:
                raise OperandTypeError(f"bad device {device!r}", field="device")
        else:
            raw_kind = getattr(device, "type", None)
            kind = raw_kind if isinstance(raw_kind, str) else ""  # no type: refused below
            raw = getattr(device, "index", None)
            index = None if raw is None else int(raw)
        if kind != self.device_type:
            raise OperandTypeError(
                f"{type(self).__name__} serves {self.device_type!r} tensors, got device {device!r}",
                field="device",
            )
        return self._current_index() if index is None else index

    def _current_runtime(self) -> Runtime:
        """The runtime of the calling thread's current device, resolved per call.

        A record's handle names a stream of that device: 0 its default stream, a nonzero
        handle the caller's stream (which LMCache takes from the current device).
        """
        index = self._current_index()
        return self._runtimes.get(index) or self._runtime(index)

    def _all_runtimes(self) -> list[Runtime]:
        with self._lock:
            return list(self._runtimes.values())

    # -- the engine-driven hot op ---------------------------------------------------------

    def multi_layer_block_kv_transfer(
        self,
        paged_buffer_ptrs_tensor: torch.Tensor | list[Any],
        lmcache_objects_ptrs: list[int] | list[torch.Tensor],
        block_ids: torch.Tensor | list[int],
        device: torch.device | str,
        direction: Any,
        shape_desc: Any,
        lmcache_chunk_size: int,
        engine_kv_format: Any,
        skip_prefix_n_blocks: int,
        layerwise: bool = False,
    ) -> None:
        """Gather (D2H) or scatter (H2D) whole blocks through the kvactors runtime.

        On CPU complete on return. On accelerators ordered after the work the calling thread
        queued on its current stream, and returning once the copies are enqueued there
        (complete on return with ``complete_on_return``).

        ``layerwise`` is the keyword LMCache's next releases add (default False, every layer in
        one call); ``layerwise=True`` is refused until kvactors supports it.

        The engine repeats every argument but the block ids and the chunks. A call whose
        operands have exactly the types of that call (lists of tensors, a list of ints, a
        ``torch.device`` of this plugin's kind, int sizes), whose other arguments converted
        before into a reusable request, and whose device's runtime exists, is checked in this
        one frame as the full conversion checks it and goes to ``Runtime.transfer`` with that
        request and this call's ids. Every other call is converted in full, which raises what
        it always raises, before anything is copied.

        Raises:
            TypeError: raw-pointer operands, or malformed operand structure.
            ValueError: the request fails validation (nothing is copied).
            UnsupportedOperationError: ``layerwise=True`` (nothing is copied).
        """
        template: TransferRequest | None = None
        index: int | None = None
        ids: tuple[int, ...] = ()
        if (
            layerwise is False
            and type(paged_buffer_ptrs_tensor) is list
            and type(lmcache_objects_ptrs) is list
            and type(block_ids) is list
            and type(lmcache_chunk_size) is int
            and type(skip_prefix_n_blocks) is int
            and type(device) is torch.device
            and device.type == self.device_type
        ):
            # The full conversion's checks of these types: check_tensor_operands' common call,
            # block_ids_tuple's list of exact ints, the request memo's key, _route's device.
            index = device.index
            layer_types = set(map(type, paged_buffer_ptrs_tensor))
            ids = tuple(block_ids)
            if (
                set(map(type, lmcache_objects_ptrs)) == _TENSOR_TYPE
                and (layer_types <= _LAYER_TENSORS or layer_types == _LIST_TYPE)
                and set(map(type, ids)) <= _INT_TYPE
            ):
                try:
                    template = self._requests[
                        (
                            engine_kv_format,
                            direction,
                            lmcache_chunk_size,
                            skip_prefix_n_blocks,
                            convert.shape_facts(shape_desc),
                        )
                    ]
                except (KeyError, AttributeError, TypeError):  # not converted yet, or in full
                    template = None
        learned: list[Any] | None = None
        if template is None:  # converted and checked in full (raises before any copy)
            if type(paged_buffer_ptrs_tensor) is list:  # once accepted: learn its tensor types
                learned = paged_buffer_ptrs_tensor
            request, paged_buffer_ptrs_tensor, index = self._convert_in_full(
                paged_buffer_ptrs_tensor,
                lmcache_objects_ptrs,
                block_ids,
                device,
                direction,
                shape_desc,
                lmcache_chunk_size,
                engine_kv_format,
                skip_prefix_n_blocks,
                layerwise,
            )
        else:
            request = msgspec.structs.replace(template, block_ids=ids)
            if index is None:  # the calling thread's current device, per call
                index = self._current_index() if self.uses_streams else 0
        try:
            rt = self._runtimes[index]
        except KeyError:  # the device's first transfer: its runtime starts there
            rt = self._runtime(index)
        objects: Any = lmcache_objects_ptrs  # checked: a list of tensors
        # Counted before the call (while this thread's counts are in cache; after the copy
        # they would not be), taken back if it raises.
        try:
            counts: dict[str, int] = _tls.counts
        except AttributeError:
            counts = _my_counts()
        key = self._count_keys[request.direction]
        try:
            counts[key] += 1
        except KeyError:
            counts[key] = 1
        try:
            rt.transfer(
                request,
                paged_buffer_ptrs_tensor,
                objects,
                stream_handle=rt.backend.current_stream_handle(index) if self.uses_streams else 0,
                complete=self.complete_on_return,
            )
        except BaseException:
            counts[key] -= 1
            raise
        if learned is not None:
            kinds = set(map(type, learned))
            if kinds and all(issubclass(k, torch.Tensor) for k in kinds):
                _LAYER_TENSORS.update(kinds)

    def _convert_in_full(
        self,
        paged_buffer_ptrs_tensor: torch.Tensor | list[Any],
        lmcache_objects_ptrs: list[int] | list[torch.Tensor],
        block_ids: torch.Tensor | list[int],
        device: torch.device | str,
        direction: Any,
        shape_desc: Any,
        lmcache_chunk_size: int,
        engine_kv_format: Any,
        skip_prefix_n_blocks: int,
        layerwise: bool,
    ) -> tuple[TransferRequest, Any, int]:
        """A call's request, layers and device index, every argument converted and checked
        (the one place that raises what a malformed call raises, before anything is copied)."""
        if layerwise is not False:
            _refuse_layerwise(layerwise, self.kvactors_backend)
        convert.check_tensor_operands(paged_buffer_ptrs_tensor, lmcache_objects_ptrs)
        # The engine repeats every argument but the block ids and the chunks: a request
        # converted for the same arguments is reused with this call's ids (checked).
        same: tuple[Any, ...] | None
        try:
            if type(lmcache_chunk_size) is not int or type(skip_prefix_n_blocks) is not int:
                raise TypeError  # checked (and refused) in full
            same = (
                engine_kv_format,
                direction,
                lmcache_chunk_size,
                skip_prefix_n_blocks,
                convert.shape_facts(shape_desc),
            )
            template = self._requests.get(same)
        except (AttributeError, TypeError):  # unhashable or not a descriptor: in full
            same = template = None
        if template is not None:
            request = convert.with_block_ids(template, block_ids)
        else:
            engine_kv_format, paged_buffer_ptrs_tensor = convert.normalize_format(
                engine_kv_format, paged_buffer_ptrs_tensor
            )
            request = convert.to_transfer_request(
                engine_kv_format,
                direction,
                block_ids,
                lmcache_chunk_size,
                skip_prefix_n_blocks,
                shape_desc,
            )
            # Before the request is kept: a refused group never reaches the one-frame path.
            convert.check_one_cache_kind(paged_buffer_ptrs_tensor, request.shape.nl)
            if same is not None and convert.reusable(request, same):
                if len(self._requests) >= _REQUESTS_KEPT:
                    self._requests.clear()
                self._requests[same] = request
        return request, paged_buffer_ptrs_tensor, self._device_index(device)

    # -- completions and events (sync-then-publish through the StreamActor) ----------------

    def record_completion_on_stream(self, stream_ptr: int, kind: str, payload: bytes) -> None:
        """Publish ``(kind, payload)`` once all earlier work on ``stream_ptr`` completed.

        Handle 0 is the device's default stream (and the only stream on CPU).
        """
        if not isinstance(stream_ptr, int) or isinstance(stream_ptr, bool):
            raise OperandTypeError(
                f"stream_ptr must be an int, got {stream_ptr!r}", field="stream_ptr"
            )
        self._current_runtime().record_completion(stream_ptr, str(kind), bytes(payload))

    def drain_recorded_completions(self) -> list[tuple[str, bytes]]:
        """Every published completion since the last drain, in submission order per device."""
        return [
            (str(k), bytes(p)) for rt in self._all_runtimes() for k, p in rt.drain_completions()
        ]

    def record_event_on_stream(
        self,
        stream_ptr: int,
        event_type_name: str,
        session_id: str,
        str_metadata: dict[str, str],
        int_metadata: dict[str, int],
    ) -> None:
        """Publish an observability event once all earlier work on ``stream_ptr`` completed.

        Drained as ``(event_type_name, session_id, wall_ts, str_md, int_md)``; ``wall_ts`` is
        the call time (LMCache's torch baseline stamps at call time too).
        """
        if not isinstance(stream_ptr, int) or isinstance(stream_ptr, bool):
            raise OperandTypeError(
                f"stream_ptr must be an int, got {stream_ptr!r}", field="stream_ptr"
            )
        from kvactors.core.protocols.stream import EventRecord

        record = EventRecord(
            event_type=str(event_type_name),
            session_id=str(session_id),
            wall_ts=time.time(),
            str_fields=dict(str_metadata),
            int_fields=dict(int_metadata),
        )
        self._current_runtime().record_event(stream_ptr, record)

    def drain_recorded_events(self) -> list[tuple[str, str, float, dict[str, str], dict[str, int]]]:
        """Every published event since the last drain, in submission order per device."""
        return [
            (r.event_type, r.session_id, r.wall_ts, dict(r.str_fields), dict(r.int_fields))
            for rt in self._all_runtimes()
            for r in rt.drain_events()
        ]

    # -- raw pointers ----------------------------------------------------------------------

    def tensor_from_ptr(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """A validated, non-owning view of process-local memory; the caller keeps it alive."""
        index = self._device_index(device)
        return self._runtime(index).tensor_from_ptr(ptr, tuple(shape), dtype)

    def lmcache_memcpy_async(
        self,
        dest: int | torch.Tensor,
        src: int | torch.Tensor,
        nbytes: int,
        direction: Any,
        host_buffer_offset: int,
        host_buffer_alignments: int,
    ) -> None:
        """Copy ``nbytes`` between a host staging buffer and device memory.

        Tensor mode copies the first ``nbytes`` of the flattened tensors. Pointer mode builds
        non-owning views and splits the copy at ``host_buffer_alignments`` boundaries
        measured from ``host_buffer_offset``. Enqueued on the current stream.
        """
        if host_buffer_alignments <= 0 or host_buffer_alignments & (host_buffer_alignments - 1):
            raise TransferValidationError(
                "host_buffer_alignments must be a power of two", field="host_buffer_alignments"
            )
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise TransferValidationError(
                f"nbytes must be a non-negative int, got {nbytes!r}", field="nbytes"
            )
        d = int(convert.direction_of(direction))
        if isinstance(dest, torch.Tensor) and isinstance(src, torch.Tensor):
            device_side = dest if d == 0 else src
            index = self._device_index(device_side.device)
            rt = self._runtime(index)
            self._copy_bytes(rt, _byte_view(dest)[:nbytes], _byte_view(src)[:nbytes])
            return
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in (dest, src)):
            raise OperandTypeError(
                "lmcache_memcpy_async: dest and src must both be tensors or ints", field="dest"
            )
        if nbytes == 0:
            return
        host, dev_ptr = (src, dest) if d == 0 else (dest, src)
        assert isinstance(host, int)
        assert isinstance(dev_ptr, int)
        index = self._current_index()
        rt = self._runtime(index)
        copied = 0
        while copied < nbytes:
            room = host_buffer_alignments - ((host_buffer_offset + copied) % host_buffer_alignments)
            n = min(nbytes - copied, room)
            host_view = _host_bytes(host + copied, n)
            dev_view = rt.tensor_from_ptr(dev_ptr + copied, (n,), torch.uint8)
            if d == 0:
                self._copy_bytes(rt, dev_view, host_view)
            else:
                self._copy_bytes(rt, host_view, dev_view)
            copied += n

    def _copy_bytes(self, rt: Runtime, dst: torch.Tensor, src: torch.Tensor) -> None:
        rt.backend.copy_(dst, src)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise TransferValidationError("lmcache_memcpy_async needs contiguous tensors", field="dest")
    return t.reshape(-1).view(torch.uint8)


def _host_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    if ptr <= 0:
        raise InvalidPointerError("host pointer must be a positive integer", field="host pointer")
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


_KV_LIST_FORMATS = frozenset({4, 9})
_CROSS_LAYER_FORMATS = frozenset({0, 8})


def _resolve_registered(
    paged: object, objects: list[Any], fmt: int
) -> tuple[torch.Tensor | list[Any], list[torch.Tensor]]:
    """Handle-path pointers -> the tensors a kvactors cache context registered, or TypeError."""
    from kvactors_lmcache.handle import REGISTRY

    def refuse(what: str, ptr: int) -> OperandTypeError:
        return OperandTypeError(
            convert.POINTER_MODE_MESSAGE.format(what=what)
            + f" Pointer {ptr:#x} was not registered by a kvactors MUSA cache context.",
            field=what,
        )

    objs: list[torch.Tensor] = []
    for p in objects:
        if isinstance(p, bool) or not isinstance(p, int):
            raise OperandTypeError("mixed pointer/tensor lmcache_objects_ptrs", field="objects")
        t = REGISTRY.resolve(p)
        if t is None:
            raise refuse("lmcache_objects_ptrs", p)
        objs.append(t)
    if not (isinstance(paged, torch.Tensor) and paged.dim() == 1 and not paged.is_floating_point()):
        raise OperandTypeError(
            "handle path: paged_buffer_ptrs_tensor must be a 1-D int64 pointer tensor",
            field="paged",
        )
    layers: list[torch.Tensor] = []
    for p in (int(v) for v in paged.tolist()):
        t = REGISTRY.resolve(p)
        if t is None:
            raise refuse("paged_buffer_ptrs_tensor", p)
        layers.append(t)
    if fmt in _CROSS_LAYER_FORMATS:
        if len(layers) != 1:
            raise OperandTypeError("cross-layer formats take one paged pointer", field="paged")
        return layers[0], objs
    if fmt in _KV_LIST_FORMATS:
        if len(layers) % 2:
            raise OperandTypeError("KV-list formats take 2*NL paged pointers", field="paged")
        half = len(layers) // 2
        return [layers[:half], layers[half:]], objs
    return layers, objs


class KvactorsCpuOps(KvactorsDeviceOps):
    """CPU: synchronous (complete on return), stream handle always 0."""

    device_type: ClassVar[str] = "cpu"
    kvactors_backend: ClassVar[str] = "cpu"
    uses_streams: ClassVar[bool] = False


class KvactorsMusaOps(KvactorsDeviceOps):
    """MUSA: transfers ordered on the caller's current stream; a call returns once its copies
    are enqueued there (complete on return with ``complete_on_return``), as LMCache's own MUSA
    ops do."""

    device_type: ClassVar[str] = "musa"
    kvactors_backend: ClassVar[str] = "musa"

    def multi_layer_block_kv_transfer(
        self,
        paged_buffer_ptrs_tensor: torch.Tensor | list[Any],
        lmcache_objects_ptrs: list[int] | list[torch.Tensor],
        block_ids: torch.Tensor | list[int],
        device: torch.device | str,
        direction: Any,
        shape_desc: Any,
        lmcache_chunk_size: int,
        engine_kv_format: Any,
        skip_prefix_n_blocks: int,
        layerwise: bool = False,
    ) -> None:
        """As the base op; additionally serves the handle path's registered device pointers.

        Pointer operands are accepted only when *every* pointer is one a kvactors MUSA cache
        context registered (``kvactors_lmcache.handle``); anything else raises ``TypeError``.
        """
        if layerwise is not False:
            _refuse_layerwise(layerwise, self.kvactors_backend)
        if (
            isinstance(lmcache_objects_ptrs, list)
            and set(map(type, lmcache_objects_ptrs)) != _TENSOR_TYPE  # the engine's: no int
            and any(isinstance(p, int) and not isinstance(p, bool) for p in lmcache_objects_ptrs)
        ):
            paged_buffer_ptrs_tensor, lmcache_objects_ptrs = _resolve_registered(
                paged_buffer_ptrs_tensor, lmcache_objects_ptrs, int(engine_kv_format)
            )
        super().multi_layer_block_kv_transfer(
            paged_buffer_ptrs_tensor,
            lmcache_objects_ptrs,
            block_ids,
            device,
            direction,
            shape_desc,
            lmcache_chunk_size,
            engine_kv_format,
            skip_prefix_n_blocks,
        )


def _refuse_layerwise(layerwise: object, backend: str) -> None:
    if layerwise is True:
        raise UnsupportedOperationError(
            "multi_layer_block_kv_transfer(layerwise=True) (one layer per call) is not supported "
            "yet; call it with layerwise=False (every layer in one call, the default)",
            backend=backend,
        )
    raise OperandTypeError(f"layerwise must be a bool, got {layerwise!r}", field="layerwise")


MLU_LEGACY_MESSAGE = (
    "{op} is a legacy in-process connector op: MLU requires the MP engine_driven block "
    "transfer path (multi_layer_block_kv_transfer); kvactors does not run LMCache's torch "
    "baseline on MLU memory"
)


def _mlu_legacy(op: str) -> Callable[..., None]:
    def refuse(self: KvactorsMluOps, *args: object, **kwargs: object) -> None:
        raise UnsupportedOperationError(MLU_LEGACY_MESSAGE.format(op=op), backend="mlu")

    refuse.__name__ = refuse.__qualname__ = op
    refuse.__doc__ = f"Unsupported on MLU (raises ``NotImplementedError``): {op}."
    return refuse


class KvactorsMluOps(KvactorsDeviceOps):
    """MLU: tensor transfers only; raw-pointer entry points and the legacy in-process
    connector ops raise a clear ``NotImplementedError`` (``UnsupportedOperationError``)."""

    device_type: ClassVar[str] = "mlu"
    kvactors_backend: ClassVar[str] = "mlu"

    # LMCache's own MLU ops refuse these (NotImplementedError "MLU requires the MP
    # engine_driven block transfer path"); running the torch baseline on MLU instead would
    # treat the MLU like a CUDA-less generic device, untested and outside the MP contract.
    #: Inherited members this class refuses on purpose (see DELIBERATELY_INHERITED).
    refused_ops: ClassVar[frozenset[str]] = frozenset(
        {
            "multi_layer_kv_transfer",
            "multi_layer_kv_transfer_unilateral",
            "single_layer_kv_transfer",
            "single_layer_kv_transfer_sgl",
            "load_and_reshape_flash",
            "reshape_and_cache_back_flash",
        }
    )

    def tensor_from_ptr(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Unsupported on MLU: kvactors never turns MLU device addresses into views here."""
        raise UnsupportedOperationError(
            "tensor_from_ptr is not supported through the LMCache adapter on MLU "
            "(raw device pointers are only produced by the LMCache-driven path, which has "
            "no MLU support in LMCache 0.5.6); use tensor operands",
            backend="mlu",
        )

    def lmcache_memcpy_async(
        self,
        dest: int | torch.Tensor,
        src: int | torch.Tensor,
        nbytes: int,
        direction: Any,
        host_buffer_offset: int,
        host_buffer_alignments: int,
    ) -> None:
        """Unsupported on MLU: only the LMCache-driven (handle) path calls it."""
        raise UnsupportedOperationError(
            "lmcache_memcpy_async is an LMCache-driven (server-side staging) op; the MLU "
            "plugin serves the engine-driven path only",
            backend="mlu",
        )


# LMCache calls the inherited legacy ops by name; on MLU each one refuses (see refused_ops).
# Only ops this LMCache still has are replaced (0.5.7 removed two of them).
for _op in KvactorsMluOps.refused_ops:
    if hasattr(DeviceOps, _op):
        setattr(KvactorsMluOps, _op, _mlu_legacy(_op))

_OPS_BY_BACKEND: dict[str, type[KvactorsDeviceOps]] = {
    "cpu": KvactorsCpuOps,
    "mlu": KvactorsMluOps,
    "musa": KvactorsMusaOps,
}


def ops_class_for(backend: str) -> type[KvactorsDeviceOps]:
    """The ops class for kvactors backend ``backend`` (``cpu``, ``mlu``, ``musa``)."""
    try:
        return _OPS_BY_BACKEND[backend]
    except KeyError:
        raise InvalidSettingError(
            f"no kvactors LMCache ops for backend {backend!r}", setting="backend"
        ) from None
