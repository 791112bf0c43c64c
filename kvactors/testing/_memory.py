"""Fake device memory and host pinning bookkeeping.

Fake device memory is CPU memory; every allocation is recorded as a device range (weakly), so
a pointer view of a fake device succeeds only inside a live device range and mixing host and
device addresses fails loudly. Pinned host ranges are tracked the same way and decide whether
a ``non_blocking`` copy stays asynchronous.

The device ranges double as the allocator's statistics (``memory_allocated``,
``max_memory_allocated``, ``memory_reserved``, ``memory_stats``...): an allocation counts from
the moment it is recorded until its storage is freed (no view of it left, queued work that
uses it included). Sizes are rounded up to the vendors' caching-allocator block size, freed
blocks stay reserved (cached) until ``empty_cache``, and peaks are taken at allocations, the
only moments a peak can grow. Memory declared with ``fresh=False`` (adopted host memory) is
device memory but not an allocation.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import torch
from torch.multiprocessing import reductions

from kvactors.testing._counters import OpTally

if TYPE_CHECKING:
    from collections.abc import Callable

_T = TypeVar("_T")

__all__ = (
    "BLOCK_BYTES",
    "DeviceMemoryStats",
    "FakeMemory",
    "FakeMusart",
    "WeakStorage",
    "weak_storage",
)

BLOCK_BYTES = 512
_COMPACT_AT = 64  # holder lists drop dead entries when they pass a power of two above this
"""The caching allocators' smallest block: allocations are counted rounded up to it."""
_expired = torch.Storage._expired  # type: ignore[attr-defined]


class WeakStorage(Protocol):
    """A weak reference to a storage's C++ object (alive while any view is)."""

    cdata: int  # the reference torch keeps (``torch.Storage._expired(cdata)``)

    def expired(self) -> bool:
        """Whether the storage was freed."""
        ...


def weak_storage(storage: torch.UntypedStorage) -> WeakStorage:
    """A :class:`WeakStorage` for ``storage``."""
    return cast("WeakStorage", reductions.StorageWeakRef(storage))  # type: ignore[no-untyped-call]


class _Range:
    __slots__ = ("counted", "device", "end", "holders", "pending", "ref", "start")

    def __init__(
        self, start: int, end: int, device: int, ref: WeakStorage | None, counted: bool = False
    ) -> None:
        self.start = start
        self.end = end
        self.device = device
        self.ref = ref
        self.counted = counted  # an allocation the statistics still count as allocated
        # The device tensors the program holds over this allocation (weakly); None until the
        # first one. Queued work holds the memory too, but not as a device tensor.
        self.holders: list[_Holder] | None = None
        self.pending = False  # queued for a look since one of its holders died

    def live(self) -> bool:
        return self.ref is None or not self.ref.expired()

    def held(self) -> bool:
        """Whether the program still holds the allocation (the allocator's view)."""
        if not self.live():
            return False
        holders = self.holders
        if holders is None:
            return True
        # The first live holder answers (a pool's views stay alive): no walk per allocation.
        return any(h() is not None for h in holders)


class _Holder(weakref.ref["torch.Tensor"]):
    """A weak reference to a device tensor over an allocation, naming the allocation."""

    __slots__ = ("range",)
    range: _Range


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


class DeviceMemoryStats:
    """One fake device's allocator statistics (bytes rounded to :data:`BLOCK_BYTES`).

    ``current``/``peak`` of allocated, reserved and requested (unrounded) bytes and of the
    number of allocations, and the accumulated totals allocated and freed.
    """

    __slots__ = (
        "allocated",
        "allocated_peak",
        "allocations",
        "allocations_peak",
        "freed_bytes",
        "freed_count",
        "requested",
        "requested_peak",
        "reserved",
        "reserved_peak",
        "total_bytes",
        "total_count",
        "total_requested",
    )

    def __init__(self) -> None:
        self.allocated = self.allocated_peak = 0
        self.requested = self.requested_peak = 0
        self.reserved = self.reserved_peak = 0
        self.allocations = self.allocations_peak = 0
        self.total_bytes = self.total_count = self.total_requested = 0
        self.freed_bytes = self.freed_count = 0

    def alloc(self, nbytes: int) -> None:
        """Count one allocation of ``nbytes`` requested bytes."""
        size = _rounded(nbytes)
        self.allocated += size
        self.requested += nbytes
        self.allocations += 1
        self.total_bytes += size
        self.total_requested += nbytes
        self.total_count += 1
        self.reserved = max(self.reserved, self.allocated)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.requested_peak = max(self.requested_peak, self.requested)
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.allocations_peak = max(self.allocations_peak, self.allocations)

    def free(self, nbytes: int) -> None:
        """Count the free of an allocation of ``nbytes`` requested bytes (it stays cached)."""
        size = _rounded(nbytes)
        self.allocated -= size
        self.requested -= nbytes
        self.allocations -= 1
        self.freed_bytes += size
        self.freed_count += 1

    def release_cached(self) -> None:
        """``empty_cache``: give cached blocks back; reserved falls to what is allocated."""
        self.reserved = self.allocated

    def reset_peaks(self) -> None:
        """``reset_peak_memory_stats``: every peak restarts from its current value."""
        self.allocated_peak = self.allocated
        self.requested_peak = self.requested
        self.reserved_peak = self.reserved
        self.allocations_peak = self.allocations

    def reset_accumulated(self) -> None:
        """``reset_accumulated_memory_stats``: the allocated and freed totals restart at 0."""
        self.total_bytes = self.total_count = self.total_requested = 0
        self.freed_bytes = self.freed_count = 0

    def as_dict(self) -> dict[str, int]:
        """The ``memory_stats()`` dictionary (torch's key names, pool ``all``)."""
        out = {
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_device_alloc": self.total_count,
            "num_device_free": self.freed_count,
        }
        for key, cur, peak, total, freed in (
            (
                "allocated_bytes",
                self.allocated,
                self.allocated_peak,
                self.total_bytes,
                self.freed_bytes,
            ),
            (
                "active_bytes",
                self.allocated,
                self.allocated_peak,
                self.total_bytes,
                self.freed_bytes,
            ),
            (
                "requested_bytes",
                self.requested,
                self.requested_peak,
                self.total_requested,
                self.total_requested - self.requested,
            ),
            ("reserved_bytes", self.reserved, self.reserved_peak, self.reserved, 0),
            (
                "allocation",
                self.allocations,
                self.allocations_peak,
                self.total_count,
                self.freed_count,
            ),
            ("active", self.allocations, self.allocations_peak, self.total_count, self.freed_count),
        ):
            out[f"{key}.all.current"] = cur
            out[f"{key}.all.peak"] = peak
            out[f"{key}.all.allocated"] = total
            out[f"{key}.all.freed"] = freed
        return dict(sorted(out.items()))


class FakeMemory:
    """Device allocations and pinned host ranges of one fake vendor."""

    def __init__(self, tally: OpTally | None = None) -> None:
        self.tally = tally if tally is not None else OpTally()
        self._lock = threading.Lock()
        self._device: list[_Range] = []
        self._pinned: list[_Range] = []
        self._stats: dict[int, DeviceMemoryStats] = {}
        self._allocations: dict[int, _Range] = {}  # counted allocations by start address
        # Allocations whose device tensor died since the last look (a weak reference's
        # callback, on any thread), so that an allocation does not walk every holder list.
        self._dropped: collections.deque[_Range] = collections.deque()
        self._compact_at = _COMPACT_AT

    def add_device(self, t: torch.Tensor, index: int, *, fresh: bool = True) -> None:
        """Record the storage of ``t`` as device memory of ``index``.

        ``fresh``: a new allocation (counted, also in the allocator statistics); False only
        declares existing memory.
        """
        start, end = _span(t)
        if fresh:
            self.tally.allocation(end - start)
        with self._lock:
            self._prune_device()
            counted = fresh and end > start and start not in self._allocations
            r = _Range(start, end, index, weak_storage(t.untyped_storage()), counted)
            if counted:  # not the same storage again (an op that returned its input)
                self._stats_of(index).alloc(end - start)
                self._allocations[start] = r
            self._device.append(r)

    def moved(self, old_start: int, storage: torch.UntypedStorage) -> None:
        """The device storage that started at ``old_start`` now lives at ``storage``'s
        address (moved into shared memory): its range and allocation follow it."""
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        with self._lock:
            for r in self._device:
                if r.start == old_start and r.live():
                    r.start, r.end = start, end
                    if self._allocations.get(old_start) is r:
                        del self._allocations[old_start]
                        self._allocations[start] = r

    def hold(self, storage_ptr: int, tensor: torch.Tensor) -> None:
        """Record that the program holds device tensor ``tensor`` over the allocation
        starting at ``storage_ptr`` (no-op for memory that is not an allocation).

        The allocator statistics count an allocation as freed once no such tensor is left,
        even while queued work still uses the memory: a caching allocator hands a block
        freed by the program to later work of the same stream at once (stream order keeps
        it safe), so its numbers move when the program lets go, not when the device ran.
        """
        r = self._allocations.get(storage_ptr)
        if r is None:
            return
        with self._lock:
            if r.counted:
                holders = r.holders if r.holders is not None else []
                holder = _Holder(tensor, self._drop)
                holder.range = r
                holders.append(holder)
                if len(holders) > _COMPACT_AT and len(holders) & (len(holders) - 1) == 0:
                    holders = [h for h in holders if h() is not None]  # at powers of two
                r.holders = holders

    def _drop(self, holder: _Holder) -> None:
        """A device tensor over an allocation died (any thread, maybe under the lock)."""
        r = holder.range
        if not r.pending:  # once per allocation until looked at: the queue stays short
            r.pending = True
            self._dropped.append(r)

    def _prune_device(self) -> None:
        """Count the allocations freed since the last look (the lock is held).

        An allocation is freed when the program's last device tensor over it died (its
        holder's callback queued it in ``_dropped``) or its storage went (a device tensor
        that held it moved to other memory with ``set_``, or none ever held it). Freed device
        ranges leave the list once it doubled, so that an allocation walks no holder list.
        """
        dropped = self._dropped
        while dropped:
            r = dropped.popleft()
            r.pending = False
            self._free_if_unheld(r)
        gone: list[_Range] = []
        for r in self._allocations.values():
            ref = r.ref
            if ref is not None and _expired(ref.cdata):
                gone.append(r)
        for r in gone:
            self._free_if_unheld(r)
        if len(self._device) > self._compact_at:
            self._device = [r for r in self._device if r.live()]
            self._compact_at = max(_COMPACT_AT, 2 * len(self._device))

    def _free_if_unheld(self, r: _Range) -> None:
        if r.counted and not r.held():
            r.counted = False
            self._stats_of(r.device).free(r.end - r.start)
            if self._allocations.get(r.start) is r:
                del self._allocations[r.start]

    def _stats_of(self, index: int) -> DeviceMemoryStats:
        stats = self._stats.get(index)
        if stats is None:
            stats = self._stats[index] = DeviceMemoryStats()
        return stats

    def update_stats(self, index: int, change: Callable[[DeviceMemoryStats], None]) -> None:
        """Apply ``change`` (e.g. ``DeviceMemoryStats.reset_peaks``) after counting frees."""
        with self._lock:
            self._prune_device()
            change(self._stats_of(index))

    def read_stats(self, index: int, read: Callable[[DeviceMemoryStats], _T]) -> _T:
        """``read(stats)`` of device ``index`` after counting every free, under the lock."""
        with self._lock:
            self._prune_device()
            return read(self._stats_of(index))

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
        reach = 1
        for n, step in zip(t.shape, t.stride(), strict=True):
            reach += (n - 1) * step
        end = start + reach * t.element_size()
        with self._lock:
            for r in self._pinned:
                if r.start <= start and end <= r.end and r.live():
                    return True
        return False

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
