"""The fake vendor runtime: devices, streams, knobs and test-side inspection.

Theory of operation. One :class:`FakeVendor` backs one installed fake (``torch.mlu`` or
``torch.musa``). It owns the per-thread state (current device and current stream per
device live in a ``threading.local``, as the vendors keep them in C++ thread-local storage,
so a stream made current on one thread is not current on another), the registry from native
stream handles to streams, the lazily created default and pool streams, the fake memory
bookkeeping, and the IPC registries. ``kvactors.testing._assembly`` turns its bound methods
and per-vendor classes into module objects shaped like the real packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import types
from typing import TYPE_CHECKING, Any

import torch

from kvactors.testing._counters import OpCounter, OpCounts, OpTally
from kvactors.testing._device import FakeDevice, FakeDeviceError, parse_fake_device
from kvactors.testing._memory import DeviceMemoryStats, FakeMemory
from kvactors.testing._streams import (
    FakeEvent,
    FakeExternalStream,
    FakeStream,
    FakeStreamContext,
    StreamOwner,
)
from kvactors.testing._tensor import FakeDeviceTensor, plain, wrap
from kvactors.testing._worker import StreamWorker

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ("FakeKnobs", "FakeVendor")

_KINDS = ("mlu", "musa")
_TOTAL_MEMORY = 1 << 34
_DEFAULT_SEED = 67280421310721  # the initial seed of torch's default generators


@dataclasses.dataclass(frozen=True)
class FakeKnobs:
    """Behaviour switches of a fake vendor module (pass them to ``fake_vendor``).

    Attributes:
        seed: seeds every stream's delay generator (per stream: seed and handle).
        delay: seconds every enqueued work item waits before it runs.
        jitter: extra random wait in ``[0, jitter)`` seconds per work item.
        lazy: run work only once something waits for it (a stream or device synchronize,
            an event's synchronize, another stream's wait): reading before waiting always
            sees stale bytes, so ordering tests need no delays.
        devices: number of fake devices.
        available: ``is_available()``; False also makes ``device_count()`` 0.
        strided_d2h_bug: reproduce torch_mlu's async strided/converting D2H bug.
        pageable_async: let ``non_blocking`` copies with unpinned host memory stay async.
        pool_size: streams per device in the pool ``ExternalStream(0)`` draws from.
        vendor_constructor: provide the vendor tensor-from-storage constructor (default:
            MUSA yes, MLU no, matching torch_mlu pt2.1/pt2.4).
        ipc: provide memory IPC (MUSA ``torch.musa.ipc``; MLU storage sharing shims).
        event_ipc: provide interprocess events (``interprocess=``, ``from_ipc_handle``).
        musart: provide ``torch.musa.musart()`` (host registration).
        uuid: device properties carry a ``uuid``.
        cross_process: IPC handles open in other processes too (a spawned child with the
            fake installed): an exported storage moves into shared memory at export (its
            device's streams drained first; pointer views taken before the export keep the
            old address), exported events keep their progress in a shared-memory file.
    """

    seed: int = 0
    delay: float = 0.0
    jitter: float = 0.0
    lazy: bool = False
    devices: int = 1
    available: bool = True
    strided_d2h_bug: bool = False
    pageable_async: bool = False
    pool_size: int = 4
    vendor_constructor: bool | None = None
    ipc: bool = True
    event_ipc: bool = True
    musart: bool = True
    uuid: bool = True
    cross_process: bool = False


@dataclasses.dataclass(frozen=True)
class FakeDeviceProperties:
    """``get_device_properties(d)`` of a fake device."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    uuid: str | None


class _DeviceContext:
    """``device(d)``: switch the calling thread's current device for a block."""

    def __init__(self, vendor: FakeVendor, device: object) -> None:
        self._vendor = vendor
        self._index = -1 if device is None or device == -1 else vendor.device_index(device)
        self._prev = -1

    def __enter__(self) -> None:
        if self._index >= 0:
            self._prev = self._vendor.current_device()
            self._vendor.set_device(self._index)

    def __exit__(self, *exc: object) -> None:
        if self._prev >= 0:
            self._vendor.set_device(self._prev)


class FakeVendor:
    """The state behind one fake vendor module; yielded by ``fake_vendor`` for inspection.

    Besides the vendor API (``Stream``, ``Event``, ``current_stream`` ...) it offers test
    helpers: :meth:`empty`, :meth:`to_device`, :meth:`peek`, :meth:`inject_error`,
    :meth:`streams`, :meth:`threads`.
    """

    def __init__(self, kind: str, knobs: FakeKnobs) -> None:
        if kind not in _KINDS:
            raise ValueError(f"fake vendor kind must be one of {_KINDS}, got {kind!r}")
        self.kind = kind
        self.knobs = knobs
        self.tally = OpTally()
        self.memory = FakeMemory(self.tally)
        self.ipc_events: dict[bytes, Any] = {}
        self.ipc_storages: dict[bytes, Any] = {}
        self.open_owners: list[Any] = []
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._streams: dict[int, FakeStream] = {}
        self._defaults: dict[int, FakeStream] = {}
        self._pools: dict[int, list[FakeStream]] = {}
        self._pool_next: dict[int, int] = {}
        self._workers: list[StreamWorker] = []
        self._handles = itertools.count(1)
        # Stream handles are addresses of this process (as native queue pointers are): a
        # handle carried to another process names no stream there.
        self._stream_base = 0x7F00_0000_0000 + ((os.getpid() & 0xFFFF) << 24)
        self._closed = False
        self._initialized = False
        self.torch_devices = False  # set by the installation (claim_device_name)
        owner: StreamOwner = self  # the type checker proves the vendor is what they use
        attrs: dict[str, Any] = {"_vendor": owner, "__module__": f"torch_{kind}"}
        handle = property(lambda s: s.handle)
        self.Stream: type[FakeStream] = type(
            "Stream", (FakeStream,), {**attrs, f"{kind}_stream": handle}
        )
        self.ExternalStream: type[FakeStream] = type(
            "ExternalStream", (FakeExternalStream, self.Stream), attrs
        )
        ev_attrs: dict[str, Any] = {**attrs, f"{kind}_event": property(lambda s: s.handle)}
        self.Event: type[FakeEvent] = type("Event", (FakeEvent,), ev_attrs)
        self.StreamContext: type[FakeStreamContext] = type(
            "StreamContext", (FakeStreamContext,), attrs
        )
        count = knobs.devices if knobs.available else 0
        self.device_count = functools.lru_cache(maxsize=None)(lambda: count)
        # One random generator per device (CPU generators: device random numbers are drawn
        # on the host), seeded as torch seeds a device's default generator.
        self.default_generators: tuple[torch.Generator, ...] = tuple(
            torch.Generator().manual_seed(_DEFAULT_SEED) for _ in range(max(count, 1))
        )

    # ---- devices -------------------------------------------------------------------

    def device_index(self, device: object) -> int:
        """The ordinal ``device`` names on this vendor; ValueError for another kind."""
        if type(device) is int and 0 <= device < self.device_count():
            return device  # an ordinal already (the fake's own calls pass one)
        idx = parse_fake_device(device, self.kind, self.current_device())
        if idx is None:
            raise ValueError(f"Expected a {self.kind} device, but got: {device}")
        if idx == -1:
            idx = self.current_device()
        if not 0 <= idx < self.device_count():
            raise FakeDeviceError(f"invalid device ordinal {idx} ({self.device_count()} present)")
        return idx

    def make_device(self, index: int) -> torch.device | FakeDevice:
        """The device object of ordinal ``index``: a real ``torch.device`` when this fake
        owns the process's private device name, else a :class:`FakeDevice`."""
        if self.torch_devices:
            return torch.device(self.kind, index)
        return FakeDevice(self.kind, index)

    def is_available(self) -> bool:
        """Whether a fake device is present."""
        return self.device_count() > 0

    def current_device(self) -> int:
        """The calling thread's current device."""
        return int(getattr(self._tls, "device", 0))

    def set_device(self, device: object) -> None:
        """Set the calling thread's current device."""
        self._tls.device = self.device_index(device)

    def device(self, device: object) -> _DeviceContext:
        """Context manager switching the calling thread's current device."""
        return _DeviceContext(self, device)

    def device_of(self, obj: torch.Tensor) -> _DeviceContext:
        """Context manager making ``obj``'s device current (no-op for host tensors)."""
        return _DeviceContext(self, obj.device if isinstance(obj, FakeDeviceTensor) else None)

    def get_device_properties(self, device: object = None) -> FakeDeviceProperties:
        """Properties of a fake device."""
        idx = self.device_index(device)
        uuid = f"fake-{self.kind}-{idx:04d}" if self.knobs.uuid else None
        return FakeDeviceProperties(
            name=f"Fake {self.kind.upper()}",
            major=1,
            minor=0,
            total_memory=_TOTAL_MEMORY,
            multi_processor_count=8,
            uuid=uuid,
        )

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        """(free, total) bytes: the device's total less what its allocator reserved."""
        reserved = self.memory_reserved(device)
        return (max(0, _TOTAL_MEMORY - reserved), _TOTAL_MEMORY)

    # ---- allocator statistics (the fake memory model keeps them) --------------------

    def memory_allocated(self, device: object = None) -> int:
        """Bytes held by live allocations of ``device`` (rounded to allocator blocks)."""
        return self.memory.read_stats(self.device_index(device), lambda s: s.allocated)

    def max_memory_allocated(self, device: object = None) -> int:
        """The peak of ``memory_allocated`` since start or ``reset_peak_memory_stats``."""
        return self.memory.read_stats(self.device_index(device), lambda s: s.allocated_peak)

    def memory_reserved(self, device: object = None) -> int:
        """Bytes the caching allocator holds: live allocations and cached freed blocks."""
        return self.memory.read_stats(self.device_index(device), lambda s: s.reserved)

    def max_memory_reserved(self, device: object = None) -> int:
        """The peak of ``memory_reserved`` since start or ``reset_peak_memory_stats``."""
        return self.memory.read_stats(self.device_index(device), lambda s: s.reserved_peak)

    def reset_peak_memory_stats(self, device: object = None) -> None:
        """Restart every peak statistic of ``device`` from its current value."""
        self.memory.update_stats(self.device_index(device), DeviceMemoryStats.reset_peaks)

    def reset_max_memory_allocated(self, device: object = None) -> None:
        """Restart the peaks (torch's older name for ``reset_peak_memory_stats``)."""
        self.reset_peak_memory_stats(device)

    def reset_accumulated_memory_stats(self, device: object = None) -> None:
        """Restart the accumulated totals (``*.allocated`` / ``*.freed``) of ``device``."""
        self.memory.update_stats(self.device_index(device), DeviceMemoryStats.reset_accumulated)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        """The allocator statistics of ``device`` under torch's key names (pool ``all``)."""
        return self.memory.read_stats(self.device_index(device), DeviceMemoryStats.as_dict)

    def memory_summary(self, device: object = None, abbreviated: bool = False) -> str:
        """A readable table of ``memory_stats``."""
        idx = self.device_index(device)
        lines = [f"fake {self.kind}:{idx} memory summary"]
        lines += [
            f"  {k}: {v}"
            for k, v in self.memory_stats(idx).items()
            if not abbreviated or k.endswith((".current", ".peak"))
        ]
        return "\n".join(lines)

    def empty_cache(self, device: object = None) -> None:
        """Release cached blocks: ``memory_reserved`` falls to ``memory_allocated``."""
        indices = range(self.device_count()) if device is None else [self.device_index(device)]
        for idx in indices:
            self.memory.update_stats(idx, DeviceMemoryStats.release_cached)

    def init(self) -> None:
        """Initialise the fake runtime (no-op besides bookkeeping)."""
        self._initialized = True

    def is_initialized(self) -> bool:
        """Whether ``init`` (or any stream use) ran."""
        return self._initialized

    def ipc_collect(self) -> None:
        """Drop registry entries of IPC storages whose producer memory is gone."""
        for key in [k for k, v in self.ipc_storages.items() if v.ref.expired()]:
            del self.ipc_storages[key]

    # ---- random number generation ---------------------------------------------------

    def generator(self, device: object = None) -> torch.Generator:
        """The default generator of ``device``: random factories on it draw from it."""
        return self.default_generators[self.device_index(device)]

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""
        self.generator().manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator (``torch.manual_seed`` calls it)."""
        for g in self.default_generators:
            g.manual_seed(int(seed))

    def seed(self) -> None:
        """Seed the current device's generator with a non-deterministic number."""
        self.generator().seed()

    def seed_all(self) -> None:
        """Seed every device's generator with one non-deterministic number."""
        value = self.generator().seed()
        self.manual_seed_all(value)

    def initial_seed(self) -> int:
        """The seed of the current device's generator."""
        return int(self.generator().initial_seed())

    def get_rng_state(self, device: object = None) -> torch.Tensor:
        """The state of ``device``'s generator (a uint8 tensor)."""
        return self.generator(device).get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: object = None) -> None:
        """Restore ``device``'s generator from ``get_rng_state``'s tensor."""
        self.generator(device).set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """Every device's generator state."""
        return [g.get_state() for g in self.default_generators]

    def set_rng_state_all(self, new_states: Sequence[torch.Tensor]) -> None:
        """Restore every device's generator."""
        for g, state in zip(self.default_generators, new_states, strict=False):
            g.set_state(state)

    @staticmethod
    def _is_in_bad_fork() -> bool:
        """False: the fake survives ``fork`` (torch asks before seeding the device)."""
        return False

    # ---- streams -------------------------------------------------------------------

    def next_stream_handle(self) -> int:
        """A fresh nonzero native stream handle."""
        return self._stream_base + 0x40 * next(self._handles)

    def next_event_handle(self) -> int:
        """A fresh nonzero native event handle."""
        return 0x7E00_0000_0000 + 0x40 * next(self._handles)

    def register_stream(self, stream: FakeStream) -> StreamWorker:
        """Start the worker of a new stream and index it by handle."""
        with self._lock:
            if self._closed:
                raise FakeDeviceError(f"fake {self.kind} was removed")
            self._initialized = True
            worker = StreamWorker(
                f"fake-{self.kind}{stream.device_index}-stream-{stream.handle:#x}",
                seed=hash((self.knobs.seed, stream.handle - self._stream_base)) & 0xFFFF_FFFF,
                delay=self.knobs.delay,
                jitter=self.knobs.jitter,
                lazy=self.knobs.lazy,
            )
            self._workers.append(worker)
            self._streams[stream.handle] = stream
            return worker

    def default_stream(self, device: object = None) -> FakeStream:
        """The default stream of ``device`` (handle 0 on MUSA, nonzero on MLU)."""
        idx = self.device_index(device)
        with self._lock:
            s = self._defaults.get(idx)
            if s is None:
                s = object.__new__(self.Stream)
                handle = 0 if self.kind == "musa" else self.next_stream_handle()
                s._init(idx, 0, handle)
                self._defaults[idx] = s
            return s

    def pool_stream(self, index: int) -> FakeStream:
        """The next stream of ``index``'s pool (what ``ExternalStream(0)`` returns)."""
        with self._lock:
            pool = self._pools.setdefault(index, [])
            n = self._pool_next.get(index, 0)
            self._pool_next[index] = n + 1
            if len(pool) < self.knobs.pool_size:
                pool.append(self.Stream(device=index))
            return pool[n % len(pool)]

    def stream_by_handle(self, handle: int) -> FakeStream:
        """The stream registered under ``handle``."""
        with self._lock:
            s = self._streams.get(handle)
        if s is None or (handle == 0 and self.kind == "musa"):
            raise FakeDeviceError(f"no {self.kind} stream with handle {handle:#x}")
        return s

    def current_stream(self, device: object = None) -> FakeStream:
        """The calling thread's current stream on ``device`` (default: its default stream)."""
        idx = self.device_index(device)
        current: dict[int, FakeStream] = getattr(self._tls, "streams", {})
        s = current.get(idx)
        return s if s is not None else self.default_stream(idx)

    def set_stream(self, stream: FakeStream | None) -> None:
        """Make ``stream`` current (and its device) for the calling thread."""
        if stream is None:
            return
        if not hasattr(self._tls, "streams"):
            self._tls.streams = {}
        self._tls.streams[stream.device_index] = stream
        self._tls.device = stream.device_index

    def stream(self, stream: FakeStream | None) -> FakeStreamContext:
        """``with stream(s):`` make ``s`` current for the block (None is a no-op)."""
        return self.StreamContext(stream)

    def synchronize(self, device: object = None) -> None:
        """Wait for every stream of ``device``; raise the first sticky error."""
        idx = self.device_index(device)
        with self._lock:
            streams = [s for s in self._all_streams() if s.device_index == idx]
        errors: list[BaseException] = []
        self.tally.add("syncs")
        for s in streams:
            try:
                s.worker.synchronize()
            except FakeDeviceError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def drain(self, index: int) -> None:
        """Wait for every stream of device ``index`` without raising (errors stay sticky)."""
        with self._lock:
            streams = [s for s in self._all_streams() if s.device_index == index]
        for s in streams:
            with contextlib.suppress(FakeDeviceError):
                s.worker.synchronize(clear_error=False)

    def _all_streams(self) -> list[FakeStream]:
        return [*self._streams.values(), *self._defaults.values()]

    # ---- test helpers --------------------------------------------------------------

    def streams(self) -> list[FakeStream]:
        """Every stream created so far (default, pool and user streams)."""
        with self._lock:
            return list(dict.fromkeys(self._all_streams()))

    def threads(self) -> list[threading.Thread]:
        """The worker threads of every stream."""
        with self._lock:
            return [w.thread for w in self._workers]

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype = torch.float32, index: int = 0
    ) -> FakeDeviceTensor:
        """Allocate uninitialised fake device memory (synchronously)."""
        t = torch.empty(tuple(shape), dtype=dtype)
        self.memory.add_device(t, self.device_index(index))
        return wrap(t, self, index)

    def to_device(self, t: torch.Tensor, index: int = 0) -> FakeDeviceTensor:
        """A new fake device tensor holding a copy of host ``t`` (synchronous)."""
        out = self.empty(t.shape, t.dtype, index)
        plain(out).copy_(t)
        return out

    def adopt(self, t: torch.Tensor, index: int = 0) -> FakeDeviceTensor:
        """Declare host tensor ``t``'s storage fake device memory; a device view of ``t``.

        Keeps every stride and offset (padded, permuted, gapped views stay as they are).
        The caller must not use ``t`` itself afterwards.
        """
        self.memory.add_device(t, self.device_index(index), fresh=False)
        return wrap(t, self, index)

    def counters(self) -> OpCounts:
        """A snapshot of the device-operation counters (see :class:`OpCounts`)."""
        return self.tally.snapshot()

    def counting(self) -> OpCounter:
        """``with fake.counting() as ops: call()``; ``ops.counts`` is what the call cost."""
        return OpCounter(self.tally)

    def peek(self, t: torch.Tensor) -> torch.Tensor:
        """The bytes of device tensor ``t`` right now, ignoring every stream (a clone)."""
        return plain(t).clone()

    def inject_error(self, stream: FakeStream | None = None, message: str = "injected") -> None:
        """Enqueue a failing work item on ``stream`` (default: the current stream)."""
        s = stream if stream is not None else self.current_stream()

        def fail() -> None:
            raise FakeDeviceError(message)

        s.enqueue(fail)

    def close(self) -> None:
        """Drain and stop every stream worker (idempotent); called on ``fake_vendor`` exit."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for w in workers:
            w.stop()
        for owner in list(self.open_owners):
            with contextlib.suppress(Exception):
                owner.close()

    def module_functions(self) -> Iterator[tuple[str, Any]]:
        """(name, value) pairs shared by both vendors' module objects."""
        for name in (
            "is_available",
            "device_count",
            "current_device",
            "set_device",
            "device",
            "device_of",
            "synchronize",
            "get_device_properties",
            "mem_get_info",
            "empty_cache",
            "ipc_collect",
            "init",
            "is_initialized",
            "current_stream",
            "default_stream",
            "set_stream",
            "stream",
            "Stream",
            "ExternalStream",
            "Event",
            "StreamContext",
        ):
            yield name, getattr(self, name)
        yield "_lazy_init", self.init
        # Written out (not by name) so that dead-code checks see them used.
        yield from {
            "memory_allocated": self.memory_allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": self.memory_reserved,
            "max_memory_reserved": self.max_memory_reserved,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "reset_max_memory_allocated": self.reset_max_memory_allocated,
            "reset_accumulated_memory_stats": self.reset_accumulated_memory_stats,
            "memory_stats": self.memory_stats,
            "memory_summary": self.memory_summary,
            "manual_seed": self.manual_seed,
            "manual_seed_all": self.manual_seed_all,
            "seed": self.seed,
            "seed_all": self.seed_all,
            "initial_seed": self.initial_seed,
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state_all": self.set_rng_state_all,
            "default_generators": self.default_generators,
            "_is_in_bad_fork": self._is_in_bad_fork,
        }.items()

    def __repr__(self) -> str:
        return f"<FakeVendor {self.kind} devices={self.device_count()} knobs={self.knobs}>"


def new_module(name: str, doc: str) -> types.ModuleType:
    """A fresh module object named ``name``."""
    mod = types.ModuleType(name, doc)
    mod.__file__ = f"<kvactors.testing fake {name}>"
    return mod
