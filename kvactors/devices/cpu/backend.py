"""The CPU backend: lane threads are the streams, copies are synchronous, IPC is shared memory.

Theory of operation. On CPU a "stream" is the StreamActor's lane thread: work launched on it
has completed when ``launch`` returns, so markers are born complete and ``synchronize`` has
nothing to wait for. Stream handles still matter for ordering: handle 0 is the default lane,
and each nonzero handle names its own lane, so work submitted under one handle is ordered
exactly as on an accelerator stream. Pinning is a no-op (CPU-only torch cannot pin).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import TYPE_CHECKING, final

import torch

from kvactors.core.pointers import check_view_request
from kvactors.devices.base import Backend, IPCHandle, IPCOwner, Probe
from kvactors.devices.cpu import shm
from kvactors.errors import InvalidPointerError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.devices.base import Marker, StreamLike

__all__ = ("CpuBackend", "CpuStream")


@final
class CpuStream:
    """A CPU stream: an identity the StreamActor's lane executes in order."""

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __repr__(self) -> str:
        return f"<CpuStream {self.handle:#x}>"


@final
class _DoneMarker:
    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _DoneMarker()


class CpuBackend(Backend):
    """The real CPU backend."""

    kind = "cpu"
    completes_on_launch = True  # launch runs the work on the launching thread

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, CpuStream] = {0: CpuStream(0)}
        self._ids = itertools.count(1 << 32)

    def probe(self) -> Probe:
        """CPU is always available."""
        return Probe(
            backend="cpu",
            available=True,
            details={"torch": str(torch.__version__), "threads": str(torch.get_num_threads())},
        )

    def device(self, index: int) -> torch.device:
        """The CPU device (only index 0 exists)."""
        if index != 0:
            raise InvalidPointerError(f"cpu has only device 0, got {index}", field="device")
        return torch.device("cpu")

    def bind_thread(self, index: int, stream: StreamLike) -> None:
        """Nothing to bind on CPU."""

    def new_stream(self, index: int) -> StreamLike:
        """A fresh stream identity."""
        with self._lock:
            s = CpuStream(next(self._ids))
            self._streams[s.handle] = s
            return s

    def stream_from_handle(self, handle: int, index: int) -> StreamLike:
        """Handle 0: the default stream; any other handle: the stream of that identity."""
        self.device(index)
        with self._lock:
            s = self._streams.get(handle)
            if s is None:
                s = self._streams[handle] = CpuStream(handle)
            return s

    def stream_handle(self, stream: StreamLike) -> int:
        """The stream's handle."""
        assert isinstance(stream, CpuStream)
        return stream.handle

    def current_stream_handle(self, index: int) -> int:
        """CPU callers have no current stream: the default stream."""
        return 0

    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        """Run ``fn`` now, on the calling lane thread."""
        fn()

    def synchronize(self, stream: StreamLike) -> None:
        """Work on a CPU lane is complete when launched."""

    def record_marker(self, stream: StreamLike) -> Marker:
        """A marker that is already complete."""
        return _DONE

    def must_block(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Every CPU copy is synchronous."""
        return True

    def tensor_from_ptr(
        self,
        ptr: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        index: int = 0,
        stride: Sequence[int] | None = None,
        storage_offset: int = 0,
        nbytes: int | None = None,
        device: object = "cpu",
    ) -> torch.Tensor:
        """A validated non-owning view of host memory at ``ptr``; the caller keeps it alive."""
        dev = torch.device(device) if isinstance(device, (str, torch.device)) else None
        if dev is None or dev.type != "cpu" or (dev.index or 0) != 0 or index != 0:
            raise InvalidPointerError(f"cpu backend cannot view device {device!r}", field="device")
        if not isinstance(dtype, torch.dtype):
            raise InvalidPointerError(f"dtype must be a torch.dtype, got {dtype!r}", field="dtype")
        itemsize = torch.empty((), dtype=dtype).element_size()
        req = check_view_request(
            ptr,
            shape,
            itemsize,
            stride=stride,
            storage_offset=storage_offset,
            available_nbytes=nbytes,
        )
        if req.nbytes == 0:
            return torch.empty(req.shape, dtype=dtype)
        raw = (ctypes.c_uint8 * req.nbytes).from_address(req.ptr)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        usable = req.nbytes - req.nbytes % itemsize
        return flat[:usable].view(dtype).as_strided(req.shape, req.stride, req.storage_offset)

    def ipc_export(self, t: torch.Tensor) -> IPCHandle:
        """Export a tensor allocated with :meth:`alloc_shared`."""
        return shm.export_shared(t)

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        """Attach to an exported segment."""
        return shm.open_shared(handle)

    def alloc_shared(self, shape: Sequence[int], dtype: torch.dtype) -> shm.SharedTensor:
        """Allocate an exportable CPU tensor in shared memory."""
        return shm.alloc_shared(shape, dtype)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """CPU-only torch cannot pin; the tensor stays pageable."""
        return t
