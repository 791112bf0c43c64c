"""The kvactors ops' ``PageBufferShapeDesc``: LMCache's eight fields as plain Python values.

Theory of operation. LMCache builds the descriptor of every engine-driven transfer with
``lmcache.device_ops.PageBufferShapeDesc()``, the class of the process-global ops (a plugin's
ops may name their own), sets its fields one by one, and hands it to the transfer op, which
reads every field again (a descriptor is mutable: its identity proves nothing). Each field of
LMCache's native (pybind11) class is a C++ property, and on the caches a copy leaves behind,
reading all of them cost the op about 15 us of a small model's call.

:class:`KvactorsShapeDesc` keeps the fields in one tuple, ``values``: the eight ints, then the
dtype. Its setters accept exactly what the native setters accept (pybind11's int caster: anything
with ``__int__`` or ``__index__`` but a float, truncated, within int32; anything else is a
``TypeError``) and store an exact ``int``, so the
op reads the whole descriptor in one attribute and finds its converted form by that tuple
(:func:`kvactors_lmcache.convert.common_request`). Every write makes a new tuple; nothing can
change the values a reader holds. ``dtype`` keeps the native class's dynamic-attribute
behaviour: absent until set (``getattr(desc, "dtype", None)`` is ``None``), any object, and
deletable; other dynamic attributes are accepted too.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ("FIELDS", "UNSET", "KvactorsShapeDesc")

FIELDS: Final = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems")
"""The native descriptor's integer fields, in the order of :attr:`KvactorsShapeDesc.values`."""

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
"""The last entry of :attr:`KvactorsShapeDesc.values` while ``dtype`` was never set."""

_ZERO: Final = (0, 0, 0, 0, 0, 0, 0, 0, UNSET)


def _int32(name: str, value: object) -> int:
    # pybind11's int caster: a float (or float subclass) is refused; anything else with
    # __int__ or __index__ is converted (truncating: numpy float32 2.5 -> 2) and must fit.
    kind = type(value)
    if kind is int:
        number: int = value  # type: ignore[assignment]
    else:
        convert = (
            None
            if issubclass(kind, float)
            else (getattr(kind, "__int__", None) or getattr(kind, "__index__", None))
        )
        try:
            if convert is None:
                raise TypeError
            number = int(convert(value))
        except Exception:
            raise TypeError(
                f"PageBufferShapeDesc.{name} must be an integer, got {value!r}"
            ) from None
    if not _INT32_MIN <= number <= _INT32_MAX:
        raise TypeError(f"PageBufferShapeDesc.{name} = {number} does not fit in int32")
    return number


def _field(position: int, name: str) -> property:
    def get(self: KvactorsShapeDesc) -> int:
        value: int = self.values[position]
        return value

    def set_(self: KvactorsShapeDesc, value: object) -> None:
        old = self.values
        self.values = (*old[:position], _int32(name, value), *old[position + 1 :])

    return property(get, set_, doc=f"LMCache's ``{name}`` (int32).")


class KvactorsShapeDesc:
    """LMCache's ``PageBufferShapeDesc`` for the kvactors ops (module docstring).

    Fields default to 0, as on the native class; ``dtype`` is absent until set.
    """

    __slots__ = ("__dict__", "values")

    #: ``(kv_size, nl, nb, bs, nh, hs, element_size, block_stride_elems, dtype)``; the dtype is
    #: :data:`UNSET` while absent. Replaced, never changed, by every write.
    values: tuple[Any, ...]

    kv_size = _field(0, "kv_size")
    nl = _field(1, "nl")
    nb = _field(2, "nb")
    bs = _field(3, "bs")
    nh = _field(4, "nh")
    hs = _field(5, "hs")
    element_size = _field(6, "element_size")
    block_stride_elems = _field(7, "block_stride_elems")

    def __init__(self) -> None:
        self.values = _ZERO

    @property
    def dtype(self) -> Any:
        """The KV dtype LMCache sets (a dynamic attribute: ``AttributeError`` while absent)."""
        value = self.values[8]
        if value is UNSET:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'dtype'")
        return value

    @dtype.setter
    def dtype(self, value: Any) -> None:
        self.values = (*self.values[:8], value)

    @dtype.deleter
    def dtype(self) -> None:
        if self.values[8] is UNSET:
            raise AttributeError("dtype")
        self.values = (*self.values[:8], UNSET)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={v}" for n, v in zip(FIELDS, self.values, strict=False))
        dtype = self.values[8]
        return f"KvactorsShapeDesc({fields}{'' if dtype is UNSET else f', dtype={dtype!r}'})"
