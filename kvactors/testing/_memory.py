"""Fake device memory and host pinning bookkeeping.

Fake device memory is CPU memory; every allocation is recorded as a device range (weakly), so
a pointer view of a fake device succeeds only inside a live device range and mixing host and
device addresses fails loudly. Pinned host ranges are tracked the same way and decide whether
a ``non_blocking`` copy stays asynchronous.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol, cast

from torch.multiprocessing import reductions

from kvactors.testing._counters import OpTally

if TYPE_CHECKING:
    import torch

__all__ = ("FakeMemory", "FakeMusart", "WeakStorage", "weak_storage")


class WeakStorage(Protocol):
    """A weak reference to a storage's C++ object (alive while any view is)."""

    def expired(self) -> bool:
        """Whether the storage was freed."""
        ...


def weak_storage(storage: torch.UntypedStorage) -> WeakStorage:
    """A :class:`WeakStorage` for ``storage``."""
    return cast("WeakStorage", reductions.StorageWeakRef(storage))  # type: ignore[no-untyped-call]


class _Range:
    __slots__ = ("device", "end", "ref", "start")

    def __init__(self, start: int, end: int, device: int, ref: WeakStorage | None) -> None:
        self.start = start
        self.end = end
        self.device = device
        self.ref = ref

    def live(self) -> bool:
        return self.ref is None or not self.ref.expired()


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


class FakeMemory:
    """Device allocations and pinned host ranges of one fake vendor."""

    def __init__(self, tally: OpTally | None = None) -> None:
        self.tally = tally if tally is not None else OpTally()
        self._lock = threading.Lock()
        self._device: list[_Range] = []
        self._pinned: list[_Range] = []

    def add_device(self, t: torch.Tensor, index: int, *, fresh: bool = True) -> None:
        """Record the storage of ``t`` as device memory of ``index``.

        ``fresh``: a new allocation (counted); False only declares existing memory.
        """
        start, end = _span(t)
        if fresh:
            self.tally.allocation(end - start)
        with self._lock:
            self._device = [r for r in self._device if r.live()]
            self._device.append(_Range(start, end, index, weak_storage(t.untyped_storage())))

    def device_of(self, ptr: int, nbytes: int) -> int | None:
        """The device index owning ``[ptr, ptr+nbytes)``, or None if it is not device memory."""
        with self._lock:
            for r in reversed(self._device):
                if r.start <= ptr and ptr + nbytes <= r.end and r.live():
                    return r.device
        return None

    def add_pinned(self, t: torch.Tensor) -> None:
        """Record the storage of ``t`` as pinned host memory."""
        start, end = _span(t)
        with self._lock:
            self._pinned = [r for r in self._pinned if r.live()]
            self._pinned.append(_Range(start, end, -1, weak_storage(t.untyped_storage())))

    def register_host(self, ptr: int, size: int) -> None:
        """``musaHostRegister``: pin an explicit host range until unregistered."""
        with self._lock:
            self._pinned.append(_Range(ptr, ptr + size, -1, None))

    def unregister_host(self, ptr: int) -> bool:
        """``musaHostUnregister``: forget the range starting at ``ptr``."""
        with self._lock:
            for i, r in enumerate(self._pinned):
                if r.ref is None and r.start == ptr:
                    del self._pinned[i]
                    return True
        return False

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether every byte ``t`` can reach lies in a pinned range."""
        if t.numel() == 0:
            return True
        start = t.data_ptr()
        end = (
            start
            + max(1, sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1)
            * t.element_size()
        )
        with self._lock:
            return any(r.start <= start and end <= r.end and r.live() for r in self._pinned)

    def registered_host_ranges(self) -> list[tuple[int, int]]:
        """Explicitly registered (``musaHostRegister``) ranges as (ptr, size)."""
        with self._lock:
            return [(r.start, r.end - r.start) for r in self._pinned if r.ref is None]


class _MusaError:
    success = 0
    musaErrorInvalidValue = 1
    musaErrorHostMemoryAlreadyRegistered = 712
    musaErrorHostMemoryNotRegistered = 713


class FakeMusart:
    """``torch.musa.musart()``: host registration entry points of the MUSA runtime."""

    musaError = _MusaError
    musaHostRegisterDefault = 0x00
    musaHostRegisterPortable = 0x01
    musaHostRegisterMapped = 0x02

    def __init__(self, memory: FakeMemory) -> None:
        self._memory = memory

    def musaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        """Pin ``[ptr, ptr+size)``; returns an error code (0 = success)."""
        if ptr <= 0 or size <= 0:
            return _MusaError.musaErrorInvalidValue
        if any(p == ptr for p, _ in self._memory.registered_host_ranges()):
            return _MusaError.musaErrorHostMemoryAlreadyRegistered
        self._memory.register_host(ptr, size)
        return _MusaError.success

    def musaHostUnregister(self, ptr: int) -> int:
        """Unpin the range registered at ``ptr``."""
        if self._memory.unregister_host(ptr):
            return _MusaError.success
        return _MusaError.musaErrorHostMemoryNotRegistered

    def musaGetErrorString(self, code: int) -> str:
        """A readable name for an error code."""
        names = {v: k for k, v in vars(_MusaError).items() if isinstance(v, int)}
        return names.get(int(code), f"musaError({int(code)})")
