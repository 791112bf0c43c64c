"""The CUDA backend (torch.cuda): the same stream protocol, testable on an NVIDIA GPU.

The shared stream verbs (:class:`~kvactors.devices._torchlike.TorchLikeBackend`) on real
asynchronous hardware: handle 0 is the legacy default stream, nonzero handles are borrowed
with ``ExternalStream``, strided D2H copies stay asynchronous (correct on CUDA). Raw-pointer
views use storage + ``set_``; no IPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvactors.devices._ptrview import view_from_pointer
from kvactors.devices._torchlike import TorchLikeBackend
from kvactors.devices.base import IPCHandle, IPCOwner, Probe

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("CudaBackend",)


class CudaBackend(TorchLikeBackend):
    """The CUDA backend.

    Args:
        blocking_strided_d2h: apply the MLU blocking policy on CUDA too (default False).
    """

    kind = "cuda"
    handle_attr = "cuda_stream"

    def __init__(self, *, blocking_strided_d2h: bool = False) -> None:
        super().__init__(blocking_strided_d2h=blocking_strided_d2h)

    def _load_module(self) -> object:
        return torch.cuda

    def probe(self) -> Probe:
        """Whether torch was built with CUDA and sees a GPU; never raises."""
        try:
            built = bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as exc:
            return Probe(
                backend="cuda",
                available=False,
                reason=f"torch.cuda probe failed ({type(exc).__name__}: {exc})",
            )
        details = {
            "torch": str(torch.__version__),
            "cuda": str(torch.version.cuda),
            "device_count": str(count),
        }
        if not built:
            return Probe(
                backend="cuda",
                available=False,
                details=details,
                reason="this torch build has no CUDA support",
            )
        if count == 0:
            return Probe(
                backend="cuda",
                available=False,
                details=details,
                reason="no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
            )
        return Probe(backend="cuda", available=True, details=details)

    def device(self, index: int) -> torch.device:
        """``torch.device("cuda", index)`` (validated)."""
        self._check_index(index)
        return torch.device("cuda", index)

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
        """A validated, non-owning view of CUDA memory at ``ptr`` (this process only)."""
        return view_from_pointer(
            ptr,
            shape,
            dtype,
            self.device(index),
            backend="cuda",
            stride=stride,
            storage_offset=storage_offset,
            nbytes=nbytes,
        )

    def ipc_export(self, t: torch.Tensor) -> IPCHandle:
        """Not offered on CUDA."""
        raise self._unsupported("IPC export is not offered by the CUDA backend")

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        """Not offered on CUDA."""
        raise self._unsupported("IPC open is not offered by the CUDA backend")

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A page-locked copy (unchanged if already pinned or not a CPU tensor)."""
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()
