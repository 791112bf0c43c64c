"""Device backends: ``get_backend(kind)`` and ``probe_all()``.

Backends are imported lazily, so importing :mod:`kvactors.devices` touches no vendor
package: ``cpu`` (real), ``mlu`` (torch_mlu), ``musa`` (torch_musa), ``cuda`` (torch.cuda).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvactors.devices.base import Backend, Probe
from kvactors.errors import InvalidSettingError, SettingTypeError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("BACKEND_KINDS", "Backend", "Probe", "get_backend", "probe_all")

_REGISTRY: dict[str, str] = {
    "cpu": "kvactors.devices.cpu:CpuBackend",
    "mlu": "kvactors.devices.mlu:MluBackend",
    "musa": "kvactors.devices.musa:MusaBackend",
    "cuda": "kvactors.devices.cuda:CudaBackend",
}

BACKEND_KINDS: tuple[str, ...] = tuple(_REGISTRY)


def _backend_class(kind: str) -> type[Backend]:
    try:
        path = _REGISTRY[kind]
    except KeyError:
        raise InvalidSettingError(
            f"unknown backend kind {kind!r}; expected one of {', '.join(BACKEND_KINDS)}",
            setting="backend",
        ) from None
    module_name, _, cls_name = path.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise SettingTypeError(f"{path} is not a Backend subclass", setting="backend")
    return cls


def get_backend(kind: str) -> Backend:
    """A new backend instance of ``kind``.

    Args:
        kind: ``"cpu"``, ``"mlu"``, ``"musa"`` or ``"cuda"``.

    Returns:
        The backend; it may be unavailable here (check ``probe()``, or call ``require()``).

    Raises:
        ValueError: ``kind`` is not a known backend kind.
    """
    return _backend_class(kind)()


def probe_all(kinds: Sequence[str] = BACKEND_KINDS) -> list[Probe]:
    """Probe every backend kind; never raises (a broken backend reports itself unavailable)."""
    out: list[Probe] = []
    for kind in kinds:
        try:
            out.append(get_backend(kind).probe())
        except Exception as exc:
            out.append(Probe(backend=kind, available=False, reason=f"{type(exc).__name__}: {exc}"))
    return out
