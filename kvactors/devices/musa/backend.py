"""The Moore Threads MUSA backend (torch_musa).

Handle 0 maps to ``default_stream(index)`` (``ExternalStream(0)`` is a pool stream).
:meth:`MusaBackend.tensor_from_ptr` builds non-owning views of process-local pointers; across
processes only an :class:`~kvactors.devices.base.IPCHandle` (torch_musa's ``to_dict()``)
travels. :meth:`MusaBackend.prepare_transfer` refuses the formats LMCache's MUSA path refuses
(:mod:`kvactors.devices.musa.contract`); :meth:`MusaBackend.transfer_kernel` tries an opted-in
native transfer (:mod:`kvactors.devices.native`) before kvactors' torch kernel.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any, Protocol, final

import torch

from kvactors.devices._ptrview import StorageConstructor, view_from_pointer
from kvactors.devices._torchlike import TorchLikeBackend
from kvactors.devices._vendor import device_errors
from kvactors.devices.base import IPCHandle, Probe
from kvactors.devices.musa.contract import (
    MUSA_NATIVE_FORMATS,
    NATIVE_TRANSFER_ENV,
    MusaCapabilities,
    check_format,
    probe_capabilities,
)
from kvactors.devices.native import NativeSlot
from kvactors.errors import (
    IPCError,
    KvactorsError,
    TransferValidationError,
    UnsupportedOperationError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from kvactors.core.plans import TransferPlan, TransferRequest
    from kvactors.devices.native import NativeKvTransfer

__all__ = ("HostRegistration", "MusaBackend", "MusaIPCOwner")

_HANDLE_KEY = "musa_ipc"


class _VendorOwner(Protocol):
    @property
    def tensor(self) -> torch.Tensor: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


@final
class MusaIPCOwner:
    """Receiver-side owner of an opened MUSA IPC handle (wraps the vendor owner)."""

    def __init__(self, owner: _VendorOwner, handle: IPCHandle) -> None:
        self._owner = owner
        self.handle = handle

    @property
    def tensor(self) -> torch.Tensor:
        """The opened view (valid until :meth:`close`)."""
        if self._owner.closed:
            raise IPCError("MUSA IPC owner is closed", handle=self.handle.name)
        return self._owner.tensor

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return bool(self._owner.closed)

    def close(self) -> None:
        """Release the mapping (idempotent)."""
        if not self._owner.closed:
            try:
                self._owner.close()
            except Exception as exc:
                raise IPCError(
                    f"closing MUSA IPC owner failed: {exc}", handle=self.handle.name
                ) from exc


@final
class HostRegistration:
    """A host range pinned with ``musaHostRegister``; :meth:`close` unregisters it."""

    def __init__(self, runtime: Any, ptr: int, nbytes: int) -> None:
        self._rt = runtime
        self.ptr = ptr
        self.nbytes = nbytes
        self.closed = False

    def close(self) -> None:
        """Unregister (idempotent)."""
        if not self.closed:
            self.closed = True
            code = int(self._rt.musaHostUnregister(self.ptr))
            if code != 0:
                raise UnsupportedOperationError(
                    f"musaHostUnregister failed: {self._rt.musaGetErrorString(code)}",
                    backend="musa",
                )


class MusaBackend(TorchLikeBackend):
    """The MUSA backend.

    Args:
        blocking_strided_d2h: block strided/converting D2H copies (default True; MUSA's
            "backup" copy path has the same shape as torch_mlu's bug, unverified).
        native: a native transfer to try first (only with the opt-in env flag); default: the
            one registered under ``musa`` in the ``kvactors.native_kernels`` entry points.
        env: environment to read opt-ins from (default ``os.environ``).
    """

    kind = "musa"
    handle_attr = "musa_stream"

    def __init__(
        self,
        *,
        blocking_strided_d2h: bool = True,
        native: NativeKvTransfer | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(blocking_strided_d2h=blocking_strided_d2h)
        self._env: Mapping[str, str] = os.environ if env is None else env
        self.native = NativeSlot("musa", NATIVE_TRANSFER_ENV, native, self._env)

    def _load_module(self) -> object:
        if getattr(torch, "musa", None) is None:
            importlib.import_module("torch_musa")
        return torch.musa  # type: ignore[attr-defined]

    def probe(self) -> Probe:
        """Find torch_musa and a device; never raises."""
        try:
            mod = self._load_module()
        except Exception as exc:
            return Probe(
                backend="musa",
                available=False,
                reason=f"torch_musa is not importable ({type(exc).__name__}: {exc})",
            )
        try:
            count = int(mod.device_count()) if mod.is_available() else 0  # type: ignore[attr-defined]
            caps = probe_capabilities(mod, self._env)
        except Exception as exc:
            return Probe(
                backend="musa",
                available=False,
                reason=f"torch.musa probe failed ({type(exc).__name__}: {exc})",
            )
        details = {
            "torch_musa": str(getattr(mod, "__version__", "unknown")),
            "device_count": str(count),
            "memory_ipc": str(caps.memory_ipc),
            "event_ipc": str(caps.event_ipc),
            "handle_mode": str(caps.handle_mode),
        }
        if "MUSA_VISIBLE_DEVICES" in os.environ:
            details["MUSA_VISIBLE_DEVICES"] = os.environ["MUSA_VISIBLE_DEVICES"]
        if count == 0:
            return Probe(
                backend="musa",
                available=False,
                details=details,
                reason="torch_musa is installed but no MUSA device is visible "
                "(check MUSA_VISIBLE_DEVICES)",
            )
        return Probe(backend="musa", available=True, details=details)

    # ---- capabilities -----------------------------------------------------------------

    def capabilities(self) -> MusaCapabilities:
        """Memory IPC, event IPC and opt-in state of this build and environment."""
        return probe_capabilities(self.module, self._env)

    def lmcache_driven_unavailable(self) -> str:
        """Empty only when opt-in, memory IPC and event IPC all hold."""
        caps = self.capabilities()
        return "" if caps.handle_mode else "; ".join(caps.problems)

    # ---- memory -------------------------------------------------------------------------

    def _constructor(self) -> StorageConstructor | None:
        cext = getattr(self.module, "_MUSAC", None)
        ctor = getattr(cext, "_construct_MUSA_Tensor_From_Storage_And_Metadata", None)
        return ctor if callable(ctor) else None

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
        """A validated, non-owning view of MUSA memory at ``ptr`` (this process only)."""
        return view_from_pointer(
            ptr,
            shape,
            dtype,
            self.device(index),
            backend="musa",
            stride=stride,
            storage_offset=storage_offset,
            nbytes=nbytes,
            constructor=self._constructor(),
        )

    def _ipc_module(self) -> Any:
        from kvactors.devices.musa.contract import memory_ipc_problem

        problem = memory_ipc_problem(self.module)
        if problem:
            raise self._unsupported(f"memory IPC unavailable: {problem}")
        return getattr(self.module, "ipc")  # noqa: B009 - untyped vendor attribute

    def ipc_export(self, t: torch.Tensor) -> IPCHandle:
        """Export a MUSA tensor view; the handle carries ``to_dict()``, never a pointer."""
        ipc = self._ipc_module()
        if t.device.type != "musa":
            raise TransferValidationError("expected a MUSA tensor", field="tensor")
        with device_errors(str(t.device), "ipc_export"):
            vendor_handle = ipc.export_tensor(t)
        return IPCHandle(
            backend="musa",
            name=f"musa-ipc-{id(vendor_handle):x}",
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            storage_offset=int(t.storage_offset()),
            nbytes=t.numel() * t.element_size(),
            device_index=int(t.device.index or 0),
            extra={_HANDLE_KEY: json.dumps(vendor_handle.to_dict())},
        )

    def ipc_open(self, handle: IPCHandle) -> MusaIPCOwner:
        """Open an exported handle; fails closed if its metadata disagrees with the view."""
        ipc = self._ipc_module()
        if handle.backend != "musa" or _HANDLE_KEY not in handle.extra:
            raise IPCError(
                f"not a MUSA IPC handle (backend {handle.backend!r})", handle=handle.name
            )
        try:
            vendor_handle = ipc.MUSAIPCTensorHandle.from_dict(json.loads(handle.extra[_HANDLE_KEY]))
            owner = MusaIPCOwner(ipc.open_tensor(vendor_handle), handle)
        except KvactorsError:
            raise
        except Exception as exc:
            raise IPCError(f"opening MUSA IPC handle failed: {exc}", handle=handle.name) from exc
        view = owner.tensor
        got = (str(view.dtype).removeprefix("torch."), tuple(view.shape), tuple(view.stride()))
        if got != (handle.dtype, handle.shape, handle.stride):
            owner.close()
            raise IPCError(f"opened view {got} disagrees with the handle", handle=handle.name)
        return owner

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned copy (torch_musa's host allocator); unchanged if already pinned."""
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()

    def register_host(self, t: torch.Tensor) -> HostRegistration:
        """Pin ``t``'s memory in place with ``musaHostRegister`` (mapped); close to unpin.

        Raises:
            UnsupportedOperationError: no ``torch.musa.musart()`` or registration failed.
        """
        musart = getattr(self.module, "musart", None)
        if not callable(musart) or t.device.type != "cpu":
            raise self._unsupported("host registration needs torch.musa.musart() and a CPU tensor")
        rt = musart()
        nbytes = t.untyped_storage().nbytes()
        ptr = t.untyped_storage().data_ptr()
        code = int(rt.musaHostRegister(ptr, nbytes, 0x02))
        if code != 0:
            raise self._unsupported(f"musaHostRegister failed: {rt.musaGetErrorString(code)}")
        return HostRegistration(rt, ptr, nbytes)

    # ---- transfers ------------------------------------------------------------------

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        """Refuse formats LMCache's MUSA MP path refuses (HND, flashinfer, cross-layer...).

        Raises:
            TransferValidationError: any format but 1, 3 and 9, before memory is touched.
        """
        check_format(request.fmt)
        return request, paged, objects

    def native_provided(self) -> bool:
        """A native opted in and provided, or a subclass's own :meth:`transfer_kernel`."""
        own = type(self).transfer_kernel is not MusaBackend.transfer_kernel
        return own or self.native.get() is not None

    def transfer_kernel(
        self,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        torch_kernel: Callable[[], None],
    ) -> Callable[[], None]:
        """Native first when opted in and eligible (it may decline), else the torch kernel."""
        return self.native.kernel(
            plan, paged, objects, torch_kernel, lambda: _native_eligible(plan, paged)
        )


def _native_eligible(plan: TransferPlan, paged: object) -> bool:
    # LMCache's native MUSA kernel: NHD and MLA only, contiguous MUSA tensors, whole blocks
    # per chunk, and no prefix skip on D2H.
    req = plan.request
    if int(req.fmt) not in MUSA_NATIVE_FORMATS or req.chunk_size % req.shape.bs != 0:
        return False
    if int(plan.direction) == 1 and req.skip_blocks != 0:
        return False
    layers = paged if isinstance(paged, (list, tuple)) else [paged]
    return all(
        isinstance(t, torch.Tensor) and t.device.type == "musa" and t.is_contiguous()
        for t in layers
    )
