"""The Cambricon MLU backend (torch_mlu).

Theory of operation. torch_mlu must be imported explicitly (it registers no autoload entry
point) and then exposes ``torch.mlu`` (its ``torch_mlu.mlu`` submodule). Streams carry their
``cnrtQueue_t`` as ``.mlu_stream``; the default stream's handle is nonzero, so handle 0 is
mapped to ``default_stream(index)`` explicitly and never to ``ExternalStream(0)`` (a pool
stream). CNRT's pseudo-queues 1 (per-thread) and 2 (legacy) are refused.

Copies follow the MLU policy: device-to-host copies into non-contiguous host memory, or
with a dtype change, block (torch_mlu's asynchronous form reads a zeroed staging buffer
before the device filled it, device-apis.md 6.1). MLU addresses are never treated as host
pointers: raw-pointer views, pointer transfers, LMCache-driven IPC, arbitrary host-memory
registration and native kernels raise :class:`~kvactors.errors.UnsupportedOperationError`.
vLLM-MLU cache layouts are normalised by :mod:`kvactors.devices.mlu_layouts`.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, NoReturn

import torch

from kvactors.devices._torchlike import TorchLikeBackend
from kvactors.devices.base import IPCHandle, IPCOwner, Probe

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("MluBackend",)

_VISIBILITY_ENV = ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES")
_PSEUDO_QUEUES = {1: "cnrtQueuePerThread", 2: "cnrtQueueLegacy"}


class MluBackend(TorchLikeBackend):
    """The MLU backend.

    Args:
        blocking_strided_d2h: keep the blocking policy for strided/converting D2H copies
            (default True). False exists only to demonstrate torch_mlu's bug in tests.
    """

    kind = "mlu"
    handle_attr = "mlu_stream"

    def _load_module(self) -> object:
        importlib.import_module("torch_mlu")
        return torch.mlu  # type: ignore[attr-defined]

    def probe(self) -> Probe:
        """Import torch_mlu and look for devices; never raises."""
        try:
            pkg = importlib.import_module("torch_mlu")
        except Exception as exc:
            return Probe(
                backend="mlu", available=False,
                reason=f"torch_mlu is not importable ({type(exc).__name__}: {exc})",
            )
        try:
            mod = getattr(torch, "mlu", None)
            if mod is None:
                return Probe(backend="mlu", available=False,
                             reason="torch_mlu imported but torch.mlu is missing")
            count = int(mod.device_count()) if mod.is_available() else 0
        except Exception as exc:
            return Probe(backend="mlu", available=False,
                         reason=f"torch.mlu probe failed ({type(exc).__name__}: {exc})")
        details = {"torch_mlu": str(getattr(pkg, "__version__", "unknown")),
                   "device_count": str(count)}
        details.update({k: os.environ[k] for k in _VISIBILITY_ENV if k in os.environ})
        if count == 0:
            return Probe(
                backend="mlu", available=False, details=details,
                reason="torch_mlu is installed but no MLU device is visible "
                       "(check CN_VISIBLE_DEVICES / MLU_VISIBLE_DEVICES)",
            )
        return Probe(backend="mlu", available=True, details=details)

    def _check_handle(self, handle: int) -> None:
        if handle in _PSEUDO_QUEUES:
            raise self._unsupported(
                f"stream handle {handle} is CNRT's {_PSEUDO_QUEUES[handle]} pseudo-queue; "
                "pass a real queue handle or 0 for the default stream"
            )

    def _no_pointers(self, what: str) -> NoReturn:
        raise self._unsupported(
            f"{what} is not supported: MLU device addresses are never treated as host "
            "pointers; pass tensors (engine-driven mode)"
        )

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
        """Unsupported on MLU: raises :class:`UnsupportedOperationError`."""
        self._no_pointers("tensor_from_ptr (raw pointer views)")

    def pointer_transfer(self, *args: object, **kwargs: object) -> NoReturn:
        """Unsupported on MLU: raw pointer (pointer-mode) transfers."""
        self._no_pointers("raw pointer transfer")

    def ipc_export(self, t: torch.Tensor) -> IPCHandle:
        """Unsupported on MLU: LMCache-driven IPC has no MLU path."""
        raise self._unsupported("IPC export is not supported (no LMCache-driven mode on MLU)")

    def ipc_open(self, handle: IPCHandle) -> IPCOwner:
        """Unsupported on MLU."""
        raise self._unsupported("IPC open is not supported (no LMCache-driven mode on MLU)")

    def register_host(self, t: torch.Tensor) -> NoReturn:
        """Unsupported on MLU: torch_mlu has no binding for registering arbitrary host memory.

        Allocate pinned memory with :meth:`pin` (torch_mlu's host allocator) instead.
        """
        raise self._unsupported(
            "registering arbitrary host memory is not supported (torch_mlu has no "
            "cnrtHostRegister binding); allocate pinned memory with pin()"
        )

    def native_kernels(self) -> NoReturn:
        """Unsupported on MLU: there are no native transfer kernels; the torch path runs."""
        raise self._unsupported("native transfer kernels are not available on MLU")

    def lmcache_driven_unavailable(self) -> str:
        """LMCache-driven mode needs IPC wrappers MLU does not have."""
        return "MLU has no LMCache-driven (IPC handle) path; use engine-driven mode"

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned copy from torch_mlu's host allocator (unchanged if already pinned)."""
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()
