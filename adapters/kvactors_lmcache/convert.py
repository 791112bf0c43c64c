"""Map LMCache's transfer arguments onto kvactors' own request and operand types.

LMCache's enums map by value (``int(...)``; never imported here) onto a
:class:`~kvactors.core.plans.TransferRequest` with a :class:`~kvactors.core.layouts.ShapeDesc`;
pure, and raises before memory is touched (``TypeError`` for structure and raw pointers,
``ValueError`` for values). :func:`normalize_format` views the two formats with a size-1 axis
as HND; formats kvactors does not move are refused naming the format and its engine
(docs/formats.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.errors import OperandTypeError, TransferValidationError

if TYPE_CHECKING:
    from kvactors.devices.base import Backend

__all__ = (
    "POINTER_MODE_MESSAGE",
    "block_ids_tuple",
    "check_one_cache_kind",
    "check_tensor_operands",
    "direction_of",
    "dtype_name",
    "format_of",
    "normalize_format",
    "producers",
    "refusal_reason",
    "served_as",
    "shape_desc_of",
    "to_transfer_request",
)

POINTER_MODE_MESSAGE = (
    "kvactors adapter: multi_layer_block_kv_transfer takes tensor operands only "
    "(LMCache's tensor calling convention); got raw pointers for {what}. Raw pointers are "
    "process-local and ambiguous (pinned host memory on the engine-driven path, device "
    "memory on the LMCache-driven path), so kvactors refuses to reinterpret them."
)


_SINGLETON_AXIS_FORMATS: dict[int, tuple[KVFormat, int, str]] = {
    19: (KVFormat.NL_X_NB_TWO_NH_BS_HS, 3, "NL_X_NB_TWO_NH_ONE_BS_HS"),
    15: (KVFormat.NL_X_TWO_NB_NH_BS_HS, 3, "NL_X_TWO_NB_NH_ONE_BS_HS"),
}
"""LMCache format -> (kvactors format, the size-1 axis of each paged tensor, LMCache name)."""

_TOKEN_FOLDED = (
    "a token-folded pool ([NB*BS, ...] per tensor), which LMCache's engine-driven path does not "
    "move (its block count is undefined there)"
)
_REFUSED_FORMATS: dict[int, str] = {
    4: _TOKEN_FOLDED,
    5: _TOKEN_FOLDED,
    14: (
        "a blocked-scale format (per block: fp8 values of every token, then their fp32 "
        "scales; LMCache's torch path repacks them into token-major rows), and kvactors does "
        "not move blocked-scale pages"
    ),
    17: (
        "per-layer tuples of MLA planes of different widths and dtypes, byte-concatenated per "
        "token, which kvactors does not move"
    ),
}
"""LMCache formats kvactors refuses, with the reason (any other unknown one is refused too)."""

_SERVED: dict[int, KVFormat] = {int(f): f for f in KVFormat if int(f) not in _REFUSED_FORMATS}
"""LMCache format value -> the kvactors format it is moved as, for the formats served as is."""

REFUSAL_ADVICE = "use LMCache's own backend for this engine (docs/formats.md lists the formats)"
"""What a refusal tells the operator to do."""


def producers(value: int) -> tuple[str, str | None]:
    """``(engines, name)`` for LMCache format ``value``: who produces it and the format's name,
    from the installed LMCache's registry (its specs' ``attention_backends``)."""
    try:
        from lmcache.v1.gpu_connector.kv_format.specs.registry import SPECS
    except ImportError:  # an LMCache without the registry: nothing to name
        return "an engine this LMCache does not name", None
    for fmt, spec in SPECS.items():
        if int(fmt) == value:
            return " / ".join(spec.attention_backends) or "an unnamed engine", fmt.name
    return "an engine this LMCache's registry does not know", None


def _format_value(engine_kv_format: Any) -> int:
    try:
        return int(engine_kv_format)
    except (TypeError, ValueError) as exc:
        raise TransferValidationError(
            f"engine_kv_format {engine_kv_format!r} is not an EngineKVFormat",
            field="engine_kv_format",
        ) from exc


def served_as(value: int) -> KVFormat | None:
    """The kvactors format LMCache format ``value`` is moved as (a singleton-axis format as
    the format it views to), or ``None`` when the adapter refuses it."""
    mapped = _SINGLETON_AXIS_FORMATS.get(value)
    if mapped is not None:
        return mapped[0]
    if value in _REFUSED_FORMATS:
        return None
    try:
        return KVFormat(value)
    except ValueError:
        return None


def refusal_reason(value: int) -> str:
    """Why the adapter refuses LMCache format ``value``."""
    return _REFUSED_FORMATS.get(value, "a format this kvactors does not know")


def format_of(engine_kv_format: Any) -> KVFormat:
    """kvactors' :class:`KVFormat` for LMCache's ``EngineKVFormat`` (same numbers).

    Raises:
        TransferValidationError: a format kvactors does not move, naming it and its engine.
    """
    value = _format_value(engine_kv_format)
    fmt = _SERVED.get(value)
    if fmt is not None:
        return fmt
    engines, name = producers(value)
    reason = refusal_reason(value)
    raise TransferValidationError(
        f"kvactors does not serve engine_kv_format {name or engine_kv_format!r} (value {value}), "
        f"produced by {engines}: {reason}; {REFUSAL_ADVICE}",
        field="engine_kv_format",
    )


def normalize_format(engine_kv_format: Any, paged: Any) -> tuple[Any, Any]:
    """``(format, paged)`` with LMCache's singleton-axis formats as the kvactors format they are.

    For ``NL_X_NB_TWO_NH_ONE_BS_HS`` (LMCache 0.5.7) and ``NL_X_TWO_NB_NH_ONE_BS_HS``, each
    per-layer tensor must have exactly a size-1 axis 3; it is dropped with a view (no copy,
    same storage and strides). Every other format is returned unchanged.

    Raises:
        OperandTypeError: the paged operand is not a list of tensors.
        TransferValidationError: a tensor lacks the size-1 axis.
    """
    value = _format_value(engine_kv_format)
    mapped = _SINGLETON_AXIS_FORMATS.get(value)
    if mapped is None:
        return engine_kv_format, paged
    fmt, axis, name = mapped
    if (
        isinstance(paged, torch.Tensor)
        or not isinstance(paged, Sequence)
        or not all(isinstance(t, torch.Tensor) for t in paged)
    ):
        raise OperandTypeError(
            f"{name} needs one tensor per layer, got {type(paged).__name__}", field="paged"
        )
    views: list[torch.Tensor] = []
    for i, t in enumerate(paged):
        if t.dim() != 6 or t.shape[axis] != 1:
            raise TransferValidationError(
                f"paged tensor {i} has shape {tuple(t.shape)}; {name} needs 6 axes with a "
                f"size-1 axis {axis}",
                field="shape",
            )
        views.append(t.squeeze(axis))
    return int(fmt), views


_DIRECTIONS: dict[int, Direction] = {int(d): d for d in Direction}


def direction_of(direction: Any) -> Direction:
    """kvactors' :class:`Direction` for LMCache's ``TransferDirection`` (H2D=0, D2H=1)."""
    try:
        return _DIRECTIONS[int(direction)]
    except (TypeError, ValueError, KeyError) as exc:
        raise TransferValidationError(
            f"direction {direction!r} is neither H2D (0) nor D2H (1)", field="direction"
        ) from exc


def dtype_name(dtype: object) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; ``None`` stays ``None``."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    raise OperandTypeError(f"shape_desc.dtype {dtype!r} is not a torch.dtype", field="dtype")


_SHAPE_FIELDS = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size")
_shape_facts = operator.attrgetter(*_SHAPE_FIELDS, "block_stride_elems", "dtype")
_SHAPES: dict[tuple[Any, ...], ShapeDesc] = {}
"""A descriptor's attribute values -> its converted ShapeDesc (equal values convert alike)."""
_SHAPES_KEPT = 64


shape_facts: Callable[[Any], tuple[Any, ...]] = _shape_facts
"""``shape_facts(shape_desc)``: the attribute values of a ``PageBufferShapeDesc`` that its
conversion reads (an ``operator.attrgetter``: no Python frame on the engine's every call).
Raises ``AttributeError`` for a hand-built descriptor without ``dtype`` (or not a descriptor)."""


def reusable(request: TransferRequest, arguments: tuple[Any, ...]) -> bool:
    """Whether ``request``, converted from ``arguments`` (format, direction, chunk size,
    skipped blocks, :func:`shape_facts`), serves every later call with equal arguments:
    exact ints for the sizes (``True == 1`` must not reach a cached request), and a format
    whose paged operand :func:`normalize_format` leaves as it is."""
    fmt, _, chunk_size, skip, _ = arguments
    return (
        type(chunk_size) is int
        and type(skip) is int
        and _format_value(fmt) not in _SINGLETON_AXIS_FORMATS
        and request.chunk_size == chunk_size
    )


def with_block_ids(template: TransferRequest, block_ids: Any) -> TransferRequest:
    """``template`` (a request :func:`reusable` for this call's other arguments) with this
    call's block ids, checked as :func:`to_transfer_request` checks them."""
    return msgspec.structs.replace(template, block_ids=block_ids_tuple(block_ids))


def shape_desc_of(shape_desc: Any) -> ShapeDesc:
    """kvactors' :class:`ShapeDesc` for LMCache's ``PageBufferShapeDesc``.

    ``dtype`` is the dynamic attribute ``make_page_buffer_shape_desc`` sets; it is absent on
    hand-built descriptors, and kvactors then takes the dtype from the tensors.
    """
    facts: tuple[Any, ...] | None
    try:  # a descriptor read before: its values, one lookup (the engine reuses one per pool)
        facts = _shape_facts(shape_desc)
        known = _SHAPES.get(facts)
    except (AttributeError, TypeError):  # no dtype, or unhashable values: converted in full
        facts = known = None
    if known is not None:
        return known
    desc = _shape_desc_of(shape_desc)
    if facts is not None and len(_SHAPES) < _SHAPES_KEPT:
        _SHAPES[facts] = desc
    return desc


def _shape_desc_of(shape_desc: Any) -> ShapeDesc:
    try:
        fields = {name: int(getattr(shape_desc, name)) for name in _SHAPE_FIELDS}
        block_stride = int(getattr(shape_desc, "block_stride_elems", 0) or 0)
    except (AttributeError, TypeError, ValueError) as exc:
        raise OperandTypeError(
            f"shape_desc {shape_desc!r} is not a PageBufferShapeDesc: {exc}", field="shape_desc"
        ) from exc
    return ShapeDesc(
        **fields,
        block_stride_elems=block_stride,
        dtype=dtype_name(getattr(shape_desc, "dtype", None)),
    )


_INT = {int}


def block_ids_tuple(block_ids: Any) -> tuple[int, ...]:
    """Engine block ids as a tuple of ints (a list in tensor mode; a tensor is accepted)."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype.is_floating_point or block_ids.dim() != 1:
            raise OperandTypeError(
                f"block_ids tensor must be 1-D integer, got {block_ids.dtype} "
                f"{tuple(block_ids.shape)}",
                field="block_ids",
            )
        return tuple(int(b) for b in block_ids.tolist())
    if type(block_ids) is list:  # the engine's call: one check per distinct element type
        ids = tuple(block_ids)
        if set(map(type, ids)) <= _INT:
            return ids
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise OperandTypeError(
            f"block_ids must be a list of ints, got {type(block_ids).__name__}", field="block_ids"
        )
    out: list[int] = []
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int):
            raise OperandTypeError(f"block_ids must hold ints, got {b!r}", field="block_ids")
        out.append(b)
    return tuple(out)


def to_transfer_request(
    engine_kv_format: Any,
    direction: Any,
    block_ids: Any,
    lmcache_chunk_size: int,
    skip_prefix_n_blocks: int,
    shape_desc: Any,
) -> TransferRequest:
    """Build the kvactors request for one ``multi_layer_block_kv_transfer`` call (its format
    already normalised by :func:`normalize_format`), checking every argument."""
    return _convert_request(
        engine_kv_format,
        direction,
        block_ids,
        lmcache_chunk_size,
        skip_prefix_n_blocks,
        shape_desc,
    )


def _convert_request(
    engine_kv_format: Any,
    direction: Any,
    block_ids: Any,
    lmcache_chunk_size: int,
    skip_prefix_n_blocks: int,
    shape_desc: Any,
) -> TransferRequest:
    if isinstance(lmcache_chunk_size, bool) or not isinstance(lmcache_chunk_size, int):
        raise OperandTypeError(
            f"lmcache_chunk_size must be an int, got {lmcache_chunk_size!r}", field="chunk_size"
        )
    if isinstance(skip_prefix_n_blocks, bool) or not isinstance(skip_prefix_n_blocks, int):
        raise OperandTypeError(
            f"skip_prefix_n_blocks must be an int, got {skip_prefix_n_blocks!r}",
            field="skip_blocks",
        )
    return TransferRequest(
        fmt=int(format_of(engine_kv_format)),
        direction=int(direction_of(direction)),
        block_ids=block_ids_tuple(block_ids),
        chunk_size=lmcache_chunk_size,
        skip_blocks=skip_prefix_n_blocks,
        shape=shape_desc_of(shape_desc),
    )


def check_one_cache_kind(paged: object, nl: int) -> None:
    """Refuse a KV group whose caches are not all of one kind (shape and dtype).

    LMCache builds a group's descriptor from its first cache and counts every cache of the
    group as a layer (``shape_desc.nl`` is the cache count). A sparse-MLA model (DeepSeek
    V3.2, GLM-5 class) keeps each layer's indexer key cache beside its MLA cache in one group,
    so the cache count is not the layer count and half the caches have another shape and
    dtype. Such a group is refused by name here, before anything is copied, instead of as one
    tensor's shape inside the transfer's checks. Per-layer lists of tensors only: a
    cross-layer tensor holds one kind, and nested lists (K/V lists, plane tuples) are checked
    by the runtime.

    Args:
        paged: The paged operand as the op received it (after :func:`normalize_format`).
        nl: The layer count LMCache's descriptor states (``shape_desc.nl``).

    Raises:
        TransferValidationError: the caches differ in shape or dtype (``field="kv_caches"``).
    """
    if type(paged) is not list or len(paged) < 2:
        return
    kinds: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for i, t in enumerate(paged):
        if not isinstance(t, torch.Tensor):
            return
        dtype = str(t.dtype).removeprefix("torch.")
        kinds.setdefault((tuple(t.shape), dtype), []).append(i)
    if len(kinds) == 1:
        return
    described = "; ".join(
        f"{len(at)} x {list(shape)} {dtype} (caches {_positions(at)})"
        for (shape, dtype), at in kinds.items()
    )
    first = len(next(iter(kinds.values())))
    raise TransferValidationError(
        f"one KV group holds caches of {len(kinds)} kinds: {described}. Cache count "
        f"{len(paged)} (shape_desc.nl {nl}) is not a layer count: at most {first} caches are "
        "of the first cache's kind. A sparse-MLA model (DeepSeek V3.2, GLM-5) keeps an "
        "indexer cache beside each layer's MLA cache in one group; kvactors moves one cache "
        "kind per group and refuses this one before any copy",
        field="kv_caches",
    )


def _positions(at: list[int]) -> str:
    shown = ", ".join(map(str, at[:6]))
    return shown + (f", ... ({len(at)} in all)" if len(at) > 6 else "")


def _is_pointer_list(value: object) -> bool:
    # Per distinct element type, not per element: a list of 64 layers has one type.
    return isinstance(value, (list, tuple)) and any(
        issubclass(t, int) and t is not bool for t in set(map(type, value))
    )


def check_tensor_operands(paged: object, objects: object, backend: Backend | None = None) -> None:
    """Refuse LMCache's pointer calling convention before anything else runs.

    Raises:
        TypeError: ``objects`` holds raw pointers, or ``paged`` is a packed pointer tensor
            while the objects are not tensors.
    """
    del backend  # reserved: device checks are the runtime's
    if type(objects) is list and type(paged) is list:  # the common call, decided per type
        kinds = set(map(type, paged))
        if set(map(type, objects)) == {torch.Tensor} and (
            kinds == {torch.Tensor} or kinds == {list}
        ):
            return
    if isinstance(objects, int) or _is_pointer_list(objects):
        raise OperandTypeError(
            POINTER_MODE_MESSAGE.format(what="lmcache_objects_ptrs"), field="objects"
        )
    if not isinstance(objects, (list, tuple)) or not all(
        issubclass(t, torch.Tensor) for t in set(map(type, objects))
    ):
        raise OperandTypeError(
            "kvactors adapter: lmcache_objects_ptrs must be a list of host chunk tensors, got "
            f"{type(objects).__name__}",
            field="objects",
        )
    if isinstance(paged, int) or _is_pointer_list(paged):
        raise OperandTypeError(
            POINTER_MODE_MESSAGE.format(what="paged_buffer_ptrs_tensor"), field="paged"
        )
    if (
        isinstance(paged, torch.Tensor)
        and paged.dim() == 1
        and paged.dtype in (torch.int64, torch.uint64)
    ):
        raise OperandTypeError(
            POINTER_MODE_MESSAGE.format(what="paged_buffer_ptrs_tensor (a packed pointer tensor)"),
            field="paged",
        )
