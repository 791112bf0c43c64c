"""The backend protocol: the device edge of kvactors.

A backend wraps one device kind behind the verbs the actors need: ``bind_thread``, ``launch``,
``synchronize`` and ``record_marker`` for streams, ``copy_`` (the copy-policy hook),
``prepare_transfer`` (device layout rules before planning) and ``transfer_kernel`` (what the
lane runs). ``probe`` never raises; ``require`` raises
:class:`~kvactors.errors.BackendUnavailableError`. Streams and markers are opaque to the
runtime; across processes only an :class:`IPCHandle` travels, and ``ipc_open`` returns an
:class:`IPCOwner` kept until the streams that used it were synchronized.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, final

import msgspec

from kvactors.core.protocols.ipc import IPCHandle
from kvactors.errors import BackendUnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from kvactors.core.plans import TransferPlan, TransferRequest

__all__ = ("Backend", "IPCHandle", "IPCOwner", "Marker", "Probe", "StreamLike")


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """Result of probing a backend: whether it can run here and, if not, why."""

    backend: str
    available: bool
    reason: str = ""
    details: dict[str, str] = msgspec.field(default_factory=dict)


class StreamLike(Protocol):
    """What the runtime knows of a stream: nothing but its identity."""


class Marker(Protocol):
    """A completion marker recorded on a stream (an event on accelerators)."""

    def query(self) -> bool:
        """Whether all work recorded before the marker has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the marker completed."""
        ...


class IPCOwner(Protocol):
    """The receiver-side owner of an opened IPC mapping; its views die with ``close``."""

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor view onto the mapping (valid until ``close``)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run."""
        ...

    def close(self) -> None:
        """Release the mapping; idempotent."""
        ...


class Backend(abc.ABC):
    """One device kind behind the verbs the actors use. Subclasses fill in the device edge."""

    kind: str = ""

    # Capabilities the actors read (declared here, never inferred by the actors).
    completes_on_launch: ClassVar[bool] = False
    """``launch`` runs the work at once on the launching thread, and its marker is complete
    when ``launch`` returns (the CPU backend): a caller may launch and answer in one turn."""
    prepares_transfers: ClassVar[bool] = False
    """:meth:`prepare_transfer` adds device layout rules (else it returns its arguments)."""
    native_kernels: ClassVar[bool] = False
    """:meth:`transfer_kernel` may replace the torch kernel (else it returns it)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass that overrides a hook without declaring the capability gets it (and a
        # subclass that replaces launch, markers or synchronize no longer completes on launch).
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "prepare_transfer" in own and "prepares_transfers" not in own:
            cls.prepares_transfers = True
        if "transfer_kernel" in own and "native_kernels" not in own:
            cls.native_kernels = True
        replaced = {"launch", "record_marker", "synchronize"} & own.keys()
        if replaced and "completes_on_launch" not in own:
            cls.completes_on_launch = False

    def native_provided(self) -> bool:
        """Whether :meth:`transfer_kernel` may replace the torch kernel of this backend's
        transfers (read once, when the runtime starts): ``native_kernels`` here; a backend
        with a native slot says whether a native was opted in and provided (a subclass's own
        ``transfer_kernel`` is always called). The actors skip the hook when it is False."""
        return self.native_kernels

    @property
    def plain_transfers(self) -> bool:
        """Complete on launch, with no layout rule and no native kernel: a reused plan may
        run its specialised torch kernel."""
        return self.completes_on_launch and not self.prepares_transfers and not self.native_kernels

    @abc.abstractmethod
    def probe(self) -> Probe:
        """Report availability; never raises."""

    @final
    def require(self) -> None:
        """Raise :class:`BackendUnavailableError` unless ``probe()`` reports available."""
        p = self.probe()
        if not p.available:
            raise BackendUnavailableError(backend=self.kind, reason=p.reason)

    @abc.abstractmethod
    def device(self, index: int) -> torch.device:
        """The torch device for ``index`` (validated against the devices present)."""

    # Streams: every verb below runs on a StreamActor lane thread.

    @abc.abstractmethod
    def bind_thread(self, index: int, stream: StreamLike) -> None:
        """Make ``index`` and ``stream`` current for the calling (lane) thread."""

    @abc.abstractmethod
    def new_stream(self, index: int) -> StreamLike:
        """A stream owned by kvactors on device ``index``."""

    @abc.abstractmethod
    def stream_from_handle(self, handle: int, index: int) -> StreamLike:
        """Handle 0: the default stream of ``index``; nonzero: borrow the caller's stream."""

    @abc.abstractmethod
    def stream_handle(self, stream: StreamLike) -> int:
        """The native handle of ``stream`` as an int (process-local; never sent away)."""

    @abc.abstractmethod
    def current_stream_handle(self, index: int) -> int:
        """The native handle of the calling thread's current stream on ``index``."""

    @abc.abstractmethod
    def launch(self, stream: StreamLike, fn: Callable[[], None]) -> None:
        """Run ``fn`` so that the device work it issues is ordered on ``stream``."""

    @abc.abstractmethod
    def synchronize(self, stream: StreamLike) -> None:
        """Block until every piece of work enqueued on ``stream`` has completed."""

    @abc.abstractmethod
    def record_marker(self, stream: StreamLike) -> Marker:
        """Record a completion marker on ``stream``."""

    def must_block(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """The copy policy: whether ``dst.copy_(src)`` must block (default: never). It may
        read only the two tensors' devices, dtypes, shapes and strides: the kernels decide
        it once per cache entry."""
        return False

    @final
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` under this backend's copy policy (:meth:`must_block`)."""
        dst.copy_(src, non_blocking=not self.must_block(dst, src))

    # Transfers: two hooks GatherActor consults for every transfer.

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        """Device-specific layout rules, applied before planning (in the GatherActor's turn,
        on whichever thread runs it).

        Reads metadata only and raises (``TransferValidationError``/``OperandTypeError``)
        before any memory is touched; may return a normalised request and operand *views*
        (MLU: vLLM-MLU layouts; MUSA: LMCache's MUSA format set). Default: unchanged.
        """
        return request, paged, objects

    def transfer_kernel(
        self,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        torch_kernel: Callable[[], None],
    ) -> Callable[[], None]:
        """The callable the stream lane runs for a planned transfer.

        Default: kvactors' torch kernel. Accelerator backends return a kernel that tries an
        opted-in, eligible native transfer first (:mod:`kvactors.devices.native`).
        """
        return torch_kernel

    # Memory.

    @abc.abstractmethod
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
    ) -> torch.Tensor:
        """A validated, non-owning view of process-local memory at ``ptr``.

        ``nbytes``, when given, bounds the memory the view may reach."""

    @abc.abstractmethod
    def ipc_export(self, t: torch.Tensor) -> IPCHandle:
        """Export ``t`` for another process; the handle is wire-safe."""

    @abc.abstractmethod
    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        """Open an exported handle; the owner must be closed after the stream sync."""

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Pin a host tensor if this backend can; otherwise return it unchanged."""
        return t
