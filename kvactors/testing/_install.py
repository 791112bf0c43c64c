"""Installing a fake vendor module: :func:`fake_vendor` (re-exported by :mod:`kvactors.testing`).

Its own module so that the fixtures of :mod:`kvactors.testing.pytest_plugin` reach it without
importing the package's other public fakes (:class:`~kvactors.testing.ManualBackend` builds on
the backends, which the fake vendor modules never import).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from kvactors.testing.vendor import FakeKnobs, FakeVendor

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ("fake_vendor",)


@contextlib.contextmanager
def fake_vendor(kind: str, **knobs: Any) -> Iterator[FakeVendor]:
    """Install a fake ``torch_mlu`` or ``torch_musa`` for the duration of the block.

    Args:
        kind: ``"mlu"`` or ``"musa"``.
        **knobs: fields of :class:`FakeKnobs` (``seed``, ``delay``, ``jitter``, ``lazy``,
            ``devices``, ``available``, ``strided_d2h_bug``, ``pageable_async``,
            ``pool_size``, ``vendor_constructor``, ``ipc``, ``event_ipc``, ``musart``,
            ``uuid``, ``cross_process``).

    Yields:
        The :class:`FakeVendor` behind the module, for inspection and fault injection.

    Raises:
        RuntimeError: the real (or another fake) module of that kind is already present.
        TypeError: an unknown knob.

    On exit every stream is drained and its thread joined, and ``sys.modules``, ``torch``
    and the patched torch entry points are restored.
    """
    from kvactors.testing._assembly import Installation

    names = {f.name for f in dataclasses.fields(FakeKnobs)}
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise TypeError(f"unknown fake_vendor knobs: {unknown}")
    vendor = FakeVendor(kind, FakeKnobs(**knobs))
    inst = Installation(vendor)
    try:
        inst.install()
        yield vendor
    finally:
        try:
            vendor.close()
        finally:
            inst.uninstall()
