"""The kvactors ops' ``PageBufferShapeDesc``: LMCache's eight fields as plain Python values.

Theory of operation. LMCache builds the descriptor of every engine-driven transfer with
``lmcache.device_ops.PageBufferShapeDesc()``, the class of the process-global ops (a plugin's
ops may name their own), sets its fields one by one, and hands it to the transfer op, which
reads every field again (a descriptor is mutable: its identity proves nothing). Each field of
LMCache's native (pybind11) class is a C++ property, and on the caches a copy leaves behind,
reading all of them cost the op about 18 us of a small model's call.

:class:`KvactorsShapeDesc` keeps each field as an entry of its own in the instance
dictionary, and :func:`values_of` reads the eight ints as one tuple in one C call, and the
dtype. The setters accept exactly what the native setters accept (pybind11's int caster:
anything with ``__int__`` or ``__index__`` but a float, truncated, within int32; anything
else is a ``TypeError``, here :class:`~kvactors.errors.OperandTypeError`) and store an exact
``int``, so the op finds the converted form by those values without checking a type
(:func:`kvactors_lmcache.convert.common_request`). Each write stores one entry, as each native
setter stores one field, so writes from several threads are never lost. ``dtype``
keeps the native class's dynamic-attribute behaviour: absent until set
(``getattr(desc, "dtype", None)`` is ``None``), any object, deletable; other dynamic
attributes are accepted too.
"""

from __future__ import annotations

import operator
from typing import Any, Final

from kvactors.errors import OperandTypeError

__all__ = ("FIELDS", "UNSET", "KvactorsShapeDesc", "values_of")

FIELDS: Final = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems")
"""The native descriptor's integer fields, in the order of :func:`values_of`."""

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
"""The dtype :func:`values_of` gives while ``dtype`` was never set (or was deleted)."""


def _refused(name: str, why: str) -> OperandTypeError:
    return OperandTypeError(f"PageBufferShapeDesc.{name} {why}", field=f"shape_desc.{name}")


def _int32(name: str, value: object) -> int:
    # pybind11's int caster: a float (or float subclass) is refused; anything else with
    # __int__ or __index__ is converted (truncating: numpy float32 2.5 -> 2) and must fit.
    kind = type(value)
    if kind is int:
        number: int = value  # type: ignore[assignment]
    else:
        to_int = None
        if not issubclass(kind, float):
            to_int = getattr(kind, "__int__", None) or getattr(kind, "__index__", None)
        if to_int is None:
            raise _refused(name, f"must be an integer, got {value!r}")
        try:
            number = int(to_int(value))
        except Exception:
            raise _refused(name, f"must be an integer, got {value!r}") from None
    if not _INT32_MIN <= number <= _INT32_MAX:
        raise _refused(name, f"= {number} does not fit in int32")
    return number


def _field(name: str) -> property:
    key = f"_{name}"

    def get(self: KvactorsShapeDesc) -> int:
        value: int = self.__dict__[key]
        return value

    def set_(self: KvactorsShapeDesc, value: object) -> None:
        self.__dict__[key] = _int32(name, value)

    return property(get, set_, doc=f"LMCache's ``{name}`` (int32).")


_ZEROS: Final = {f"_{name}": 0 for name in FIELDS}


class KvactorsShapeDesc:
    """LMCache's ``PageBufferShapeDesc`` for the kvactors ops (module docstring).

    Fields default to 0, as on the native class; ``dtype`` is absent until set.
    """

    kv_size = _field("kv_size")
    nl = _field("nl")
    nb = _field("nb")
    bs = _field("bs")
    nh = _field("nh")
    hs = _field("hs")
    element_size = _field("element_size")
    block_stride_elems = _field("block_stride_elems")

    def __init__(self) -> None:
        self.__dict__.update(_ZEROS)

    @property
    def dtype(self) -> Any:
        """The KV dtype LMCache sets (a dynamic attribute: ``AttributeError`` while absent)."""
        return self._dtype

    @dtype.setter
    def dtype(self, value: Any) -> None:
        self._dtype = value

    @dtype.deleter
    def dtype(self) -> None:
        del self._dtype  # AttributeError while absent, as on the native class

    def __repr__(self) -> str:
        ints, dtype = values_of(self)
        fields = ", ".join(f"{n}={v}" for n, v in zip(FIELDS, ints, strict=True))
        return f"KvactorsShapeDesc({fields}{'' if dtype is UNSET else f', dtype={dtype!r}'})"


_ints_of: Final = operator.attrgetter(*(f"_{name}" for name in FIELDS))


def values_of(desc: KvactorsShapeDesc) -> tuple[tuple[int, ...], Any]:
    """``((kv_size, nl, nb, bs, nh, hs, element_size, block_stride_elems), dtype)`` of a
    descriptor, the dtype :data:`UNSET` while absent. The eight are read in one C call, which
    runs no Python code, so no other thread writes between them."""
    return _ints_of(desc), desc.__dict__.get("_dtype", UNSET)
