"""Operand checks behind :func:`kvactors.core.plans.plan_transfer` (metadata only, never data).

Theory of operation. Each helper validates one aspect of the operands and raises the project's
``ValueError``/``TypeError`` leaves with a ``field``; none reads tensor contents. Paged tensors
are checked for self-overlap (a sufficient test: sorted by stride, every stride reaches past
the extent of the smaller ones) because a write through an overlapping view has no defined
result, and overlap would also break the "untouched regions stay untouched" guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvactors.core.layouts import DTYPE_ITEMSIZE, FormatSpec, PagedKind, ShapeDesc
from kvactors.errors import OperandTypeError, TransferValidationError

__all__ = (
    "check_objects",
    "check_objects_structure",
    "check_paged_tensors",
    "dtype_name",
    "non_overlapping",
    "normalize_paged",
    "resolve_dtype",
    "unit_strides",
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def non_overlapping(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two in-range indices of a strided view share an element (sufficient test)."""
    dims = sorted((st, n) for n, st in zip(size, stride, strict=True) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return False
        extent += (n - 1) * st
    return True


def unit_strides(spec: FormatSpec, t: torch.Tensor) -> dict[str, int]:
    """Strides of one paged tensor by axis letter; axes the format lacks get 0 (size 1)."""
    st = dict.fromkeys("LPBSHD", 0)
    st.update(zip(spec.axes, t.stride(), strict=True))
    return st


def _first_tensor(value: object, depth: int = 0) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if depth < 2 and isinstance(value, (list, tuple)):
        for v in value:
            found = _first_tensor(v, depth + 1)
            if found is not None:
                return found
    return None


def resolve_dtype(shape: ShapeDesc, paged: object, objects: object) -> str:
    """The transfer's dtype name (step 3 of the validation order)."""
    es = shape.element_size
    if isinstance(es, bool) or not isinstance(es, int):
        raise OperandTypeError(f"element_size must be an int, got {es!r}", field="element_size")
    if shape.dtype is not None:
        name = shape.dtype
        if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPE_ITEMSIZE:
            raise TransferValidationError(f"unsupported KV dtype {name!r}", field="dtype")
        name = name.removeprefix("torch.")
        if DTYPE_ITEMSIZE[name] != es:
            raise TransferValidationError(
                f"shape.dtype {name} has {DTYPE_ITEMSIZE[name]} bytes, element_size is {es}",
                field="element_size",
            )
        return name
    found = _first_tensor(paged)
    if found is None:
        found = _first_tensor(objects, depth=1)
    if found is not None:
        name = dtype_name(found.dtype)
        if name not in DTYPE_ITEMSIZE:
            raise TransferValidationError(f"unsupported KV dtype {name}", field="dtype")
        return name
    if es == 2:
        raise TransferValidationError(
            "element_size 2 is ambiguous (float16 or bfloat16) and no tensor or shape.dtype "
            "says which",
            field="dtype",
        )
    by_size = {1: "uint8", 4: "float32"}
    if es not in by_size:
        raise TransferValidationError(f"unsupported element_size {es}", field="element_size")
    return by_size[es]


def _tensor_list(value: object, field: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise OperandTypeError(
            f"{field} must be a sequence of tensors, got {type(value).__name__}", field=field
        )
    out = list(value)
    for t in out:
        if not isinstance(t, torch.Tensor):
            raise OperandTypeError(
                f"{field} must hold tensors, got {type(t).__name__}", field=field
            )
    return out


def _merged_width(t: torch.Tensor, n_axes: int, i: int) -> torch.Tensor:
    """A one-plane paged tensor that carries ``D`` as two trailing axes ``[2, D/2]`` (K, V),
    as the view with one ``D`` axis; any other tensor as given (the shape check names it).

    Raises:
        TransferValidationError: the two axes are not one evenly strided run (merging them
            would need a copy, and a scatter into a copy is lost).
    """
    if t.dim() != n_axes + 1 or t.size(-2) != 2:
        return t
    size, stride = tuple(t.shape), t.stride()
    inner = size[-1]
    if inner > 1 and stride[-2] != inner * stride[-1]:
        raise TransferValidationError(
            f"paged tensor {i} has K/V axes {size[-2:]} with strides {stride[-2:]}: not one "
            "evenly strided run of the packed width, so they cannot be merged without a copy",
            field="paged",
        )
    d_stride = stride[-1] if inner > 1 else stride[-2]
    return t.as_strided((*size[:-2], 2 * inner), (*stride[:-2], d_stride), t.storage_offset())


def _pairs(spec: FormatSpec, paged: object) -> list[torch.Tensor]:
    """``[(K_0, V_0), ...]`` as ``[K_0.., V_0..]``."""
    if isinstance(paged, torch.Tensor) or not isinstance(paged, Sequence):
        raise OperandTypeError(
            f"{spec.fmt.name} needs [(K, V), ...] per layer, got {type(paged).__name__}",
            field="paged",
        )
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for i, pair in enumerate(paged):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise OperandTypeError(
                f"{spec.fmt.name} layer {i} must be a (K, V) pair of tensors, got "
                f"{type(pair).__name__}",
                field="paged",
            )
        k, v = _tensor_list(pair, "paged")
        ks.append(k)
        vs.append(v)
    return ks + vs


def normalize_paged(spec: FormatSpec, paged: object) -> list[torch.Tensor]:
    """The paged operand as a flat list of tensors (K list first for K/V lists and pairs)."""
    if spec.kind is PagedKind.CROSS_LAYER:
        if not isinstance(paged, torch.Tensor):
            raise OperandTypeError(
                f"{spec.fmt.name} needs one tensor, got {type(paged).__name__}", field="paged"
            )
        return [paged]
    if spec.kind is PagedKind.LAYER_LIST:
        units = _tensor_list(paged, "paged")
        if spec.single_plane:
            return [_merged_width(t, len(spec.axes), i) for i, t in enumerate(units)]
        return units
    if spec.kind is PagedKind.KV_PAIRS:
        return _pairs(spec, paged)
    if isinstance(paged, torch.Tensor) or not isinstance(paged, Sequence):
        raise OperandTypeError(
            f"{spec.fmt.name} needs [[K...], [V...]], got {type(paged).__name__}", field="paged"
        )
    items = list(paged)
    if len(items) == 2 and all(
        isinstance(v, Sequence) and not isinstance(v, (str, bytes)) for v in items
    ):
        k, v = _tensor_list(items[0], "paged"), _tensor_list(items[1], "paged")
        if len(k) != len(v):
            raise TransferValidationError(
                f"K and V lists differ in length ({len(k)} != {len(v)})", field="paged"
            )
        return k + v
    flat = _tensor_list(items, "paged")
    if len(flat) % 2:
        raise TransferValidationError(
            f"a flat K/V list needs an even length, got {len(flat)}", field="paged"
        )
    return flat


def check_objects_structure(objects: object) -> list[torch.Tensor]:
    """The objects as a list of tensors, or :class:`OperandTypeError`."""
    return _tensor_list(objects, "objects")


def _device_str(d: torch.device) -> str:
    return d.type if d.type == "cpu" else f"{d.type}:{d.index or 0}"


def check_paged_tensors(
    spec: FormatSpec,
    shape: ShapeDesc,
    units: list[torch.Tensor],
    dtype: str,
    device_type: str,
    device_index: int | None,
) -> str:
    """Check every paged tensor; return the device they share as a string."""
    want = spec.tensor_shape(shape.nl, shape.nb, shape.bs, shape.nh, shape.hs)
    bse = shape.block_stride_elems
    first_index: int | None = None
    checked: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    ok_dtype: torch.dtype | None = None
    for i, t in enumerate(units):
        if t.dtype is not ok_dtype:
            if dtype_name(t.dtype) != dtype:
                raise TransferValidationError(
                    f"paged tensor {i} has dtype {dtype_name(t.dtype)}, expected {dtype}",
                    field="dtype",
                )
            if t.element_size() != shape.element_size:
                raise TransferValidationError(
                    f"element_size {shape.element_size} does not match {dtype}",
                    field="element_size",
                )
            ok_dtype = t.dtype
        dev = t.device
        idx = dev.index or 0
        if dev.type != device_type or (device_index is not None and idx != device_index):
            where = device_type if device_index is None else f"{device_type}:{device_index}"
            raise TransferValidationError(
                f"paged tensor {i} is on {dev}, expected {where}", field="device"
            )
        if first_index is None:
            first_index = idx
        elif idx != first_index:
            raise TransferValidationError("paged tensors span several devices", field="device")
        key = (tuple(t.shape), t.stride())
        if key in checked:
            continue
        if key[0] != want:
            raise TransferValidationError(
                f"paged tensor {i} has shape {key[0]}, {spec.fmt.name} needs {want}",
                field="shape",
            )
        if bse and key[1][spec.axes.index("B")] != bse:
            raise TransferValidationError(
                f"paged tensor {i} has block stride {key[1][spec.axes.index('B')]}, "
                f"shape says {bse}",
                field="block_stride_elems",
            )
        if not non_overlapping(*key):
            raise TransferValidationError(
                f"paged tensor {i} has overlapping memory (stride {key[1]})", field="paged"
            )
        checked.add(key)
    return _device_str(units[0].device)


def check_objects(
    spec: FormatSpec, shape: ShapeDesc, objs: list[torch.Tensor], dtype: str, chunk: int
) -> None:
    """Check every host chunk: CPU, dtype, contiguous, shape (one-plane formats also
    ``[1, NL, T, NH*HS]``)."""
    want = spec.object_shape(shape.nl, chunk, shape.nh, shape.hs)
    alt = (1, *want) if spec.planes == 1 else want
    for i, o in enumerate(objs):
        if o.device.type != "cpu":
            raise TransferValidationError(
                f"object {i} is on {o.device}; host chunks must be CPU tensors", field="objects"
            )
        if dtype_name(o.dtype) != dtype:
            raise TransferValidationError(
                f"object {i} has dtype {dtype_name(o.dtype)}, expected {dtype}", field="dtype"
            )
        if tuple(o.shape) not in (want, alt):
            raise TransferValidationError(
                f"object {i} has shape {tuple(o.shape)}, expected {want}", field="objects"
            )
        if not o.is_contiguous():
            raise TransferValidationError(f"object {i} is not contiguous", field="objects")
        reach = (o.storage_offset() + o.numel()) * o.element_size()
        if reach > o.untyped_storage().nbytes():
            raise TransferValidationError(
                f"object {i} reaches past its storage ({reach} > "
                f"{o.untyped_storage().nbytes()} bytes)",
                field="objects",
            )
