"""Validation of raw-pointer view requests (pure: no device state, nothing dereferenced).

Theory of operation. A raw pointer is a process-local address: kvactors only ever turns one
into a non-owning view inside the process that owns the allocation, and never sends one across
a process boundary. Before any backend builds a view, :func:`check_view_request` normalises the
request and rejects every malformed field with :class:`~kvactors.errors.InvalidPointerError`,
so a bad request cannot alias memory it does not describe.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvactors.errors import InvalidPointerError

__all__ = ("ViewRequest", "check_view_request", "contiguous_strides", "required_nbytes")


class ViewRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A normalised, validated view request."""

    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    itemsize: int
    nbytes: int


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, for ``shape``."""
    strides: list[int] = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def required_nbytes(
    shape: Sequence[int], stride: Sequence[int], storage_offset: int, itemsize: int
) -> int:
    """Bytes a view must be able to reach: ``(offset + 1 + sum((n-1)*s)) * itemsize``."""
    if any(n == 0 for n in shape):
        return 0
    last = storage_offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    return (last + 1) * itemsize


def _ints(value: object, field: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidPointerError(f"{field} must be a sequence of ints, got {value!r}", field=field)
    out: list[int] = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidPointerError(f"{field} must hold ints, got {v!r}", field=field)
        out.append(int(v))
    return tuple(out)


def check_view_request(
    ptr: object,
    shape: object,
    itemsize: int,
    *,
    stride: object = None,
    storage_offset: object = 0,
    available_nbytes: int | None = None,
) -> ViewRequest:
    """Validate a pointer view request; raise :class:`InvalidPointerError` on any bad field."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise InvalidPointerError(f"pointer must be an int, got {type(ptr).__name__}", field="ptr")
    if ptr <= 0:
        raise InvalidPointerError(f"pointer must be positive and non-zero, got {ptr}", field="ptr")
    shp = _ints(shape, "shape")
    if any(n < 0 for n in shp):
        raise InvalidPointerError(f"shape must be non-negative, got {shp}", field="shape")
    strd = contiguous_strides(shp) if stride is None else _ints(stride, "stride")
    if len(strd) != len(shp):
        raise InvalidPointerError(
            f"stride has {len(strd)} entries but shape has {len(shp)}", field="stride"
        )
    if any(s < 0 for s in strd):
        raise InvalidPointerError(f"stride must be non-negative, got {strd}", field="stride")
    if isinstance(storage_offset, bool) or not isinstance(storage_offset, int):
        raise InvalidPointerError("storage_offset must be an int", field="storage_offset")
    if storage_offset < 0:
        raise InvalidPointerError(
            f"storage_offset must be non-negative, got {storage_offset}", field="storage_offset"
        )
    if itemsize <= 0:
        raise InvalidPointerError(f"itemsize must be positive, got {itemsize}", field="dtype")
    nbytes = required_nbytes(shp, strd, storage_offset, itemsize)
    if available_nbytes is not None and nbytes > available_nbytes:
        raise InvalidPointerError(
            f"view needs {nbytes} bytes but only {available_nbytes} are available", field="nbytes"
        )
    return ViewRequest(
        ptr=ptr,
        shape=shp,
        stride=strd,
        storage_offset=storage_offset,
        itemsize=itemsize,
        nbytes=nbytes,
    )
