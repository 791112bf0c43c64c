"""The Cambricon MLU backend (torch_mlu).

torch_mlu is imported explicitly. Handle 0 maps to ``default_stream(index)``, never
``ExternalStream(0)``; CNRT pseudo-queues 1 and 2 are refused. Strided or converting D2H
copies block (torch_mlu's async form reads a zeroed staging buffer). MLU addresses are never
host pointers: raw-pointer views and LMCache-driven IPC raise
:class:`~kvactors.errors.UnsupportedOperationError`. :meth:`MluBackend.prepare_transfer`
applies :mod:`kvactors.devices.mlu.layouts`; :meth:`MluBackend.transfer_kernel` tries an
opted-in native transfer first.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from kvactors.core.plans import TransferRequest
from kvactors.devices._torchlike import TorchLikeBackend
from kvactors.devices.base import IPCHandle, IPCOwner, Probe
from kvactors.devices.mlu.layouts import (
    LayoutSource,
    layout_source_from_env,
    normalize_mlu_transfer,
)
from kvactors.devices.native import NativeSlot
from kvactors.errors import InvalidSettingError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from kvactors.core.plans import TransferPlan
    from kvactors.devices.native import NativeKvTransfer

__all__ = ("NATIVE_TRANSFER_ENV", "MluBackend")

NATIVE_TRANSFER_ENV = "KVACTORS_MLU_NATIVE_KV_TRANSFER"
"""Opt-in for a native MLU transfer (there is no LMCache equivalent)."""

_VISIBILITY_ENV = ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES")
_PSEUDO_QUEUES = {1: "cnrtQueuePerThread", 2: "cnrtQueueLegacy"}


class MluBackend(TorchLikeBackend):
    """The MLU backend.

    Args:
        blocking_strided_d2h: keep the blocking policy for strided/converting D2H copies
            (default True). False exists only to demonstrate torch_mlu's bug in tests.
        layout_source: where format-1 (NHD) requests come from: ``"legacy"`` (vLLM's legacy
            layout answer; the memory is HND, as vLLM-MLU allocates it) or ``"resolved"``
            (the engine resolved NHD explicitly). Default: ``KVACTORS_MLU_LAYOUT_SOURCE``;
            when neither is set, format 1 is refused as ambiguous.
        native: a native transfer to try first (only with ``KVACTORS_MLU_NATIVE_KV_TRANSFER=1``);
            default: the one registered under ``mlu`` in ``kvactors.native_kernels``.
        env: environment to read the variables from (default ``os.environ``).

    Raises:
        ValueError: an unknown ``layout_source`` (argument or variable).
    """

    kind = "mlu"
    handle_attr = "mlu_stream"

    def __init__(
        self,
        *,
        blocking_strided_d2h: bool = True,
        layout_source: LayoutSource | None = None,
        native: NativeKvTransfer | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(blocking_strided_d2h=blocking_strided_d2h)
        environ: Mapping[str, str] = os.environ if env is None else env
        if layout_source is None:
            layout_source = layout_source_from_env(environ)
        elif layout_source not in ("legacy", "resolved"):
            raise InvalidSettingError(
                f"layout_source must be 'legacy' or 'resolved', got {layout_source!r}",
                setting="layout_source",
            )
        self.layout_source: LayoutSource | None = layout_source
        self.native = NativeSlot("mlu", NATIVE_TRANSFER_ENV, native, environ)

    def _load_module(self) -> object:
        importlib.import_module("torch_mlu")
        return torch.mlu  # type: ignore[attr-defined]

    def probe(self) -> Probe:
        """Import torch_mlu and look for devices; never raises."""
        try:
            pkg = importlib.import_module("torch_mlu")
        except Exception as exc:
            return Probe(
                backend="mlu",
                available=False,
                reason=f"torch_mlu is not importable ({type(exc).__name__}: {exc})",
            )
        try:
            mod = getattr(torch, "mlu", None)
            if mod is None:
                return Probe(
                    backend="mlu",
                    available=False,
                    reason="torch_mlu imported but torch.mlu is missing",
                )
            count = int(mod.device_count()) if mod.is_available() else 0
        except Exception as exc:
            return Probe(
                backend="mlu",
                available=False,
                reason=f"torch.mlu probe failed ({type(exc).__name__}: {exc})",
            )
        details = {
            "torch_mlu": str(getattr(pkg, "__version__", "unknown")),
            "device_count": str(count),
        }
        details.update({k: os.environ[k] for k in _VISIBILITY_ENV if k in os.environ})
        if count == 0:
            return Probe(
                backend="mlu",
                available=False,
                details=details,
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

    def lmcache_driven_unavailable(self) -> str:
        """LMCache-driven mode needs IPC wrappers MLU does not have."""
        return "MLU has no LMCache-driven (IPC handle) path; use engine-driven mode"

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned copy from torch_mlu's host allocator (unchanged if already pinned)."""
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()

    # ---- transfers ------------------------------------------------------------------

    def prepare_transfer(
        self, request: TransferRequest, paged: Any, objects: Sequence[torch.Tensor]
    ) -> tuple[TransferRequest, Any, Sequence[torch.Tensor]]:
        """vLLM-MLU layouts (see :mod:`kvactors.devices.mlu.layouts`); metadata and views only.

        Raises:
            TransferValidationError: a format MLU does not take, an undeclared format 1, or a
                layer entry whose scale/indexer cache would be lost.
            OperandTypeError: a malformed ``[cache, scale, index]`` entry.
        """
        fmt, shape, chunk, layers, objs = normalize_mlu_transfer(
            request.fmt, request.shape, request.chunk_size, paged, objects, self.layout_source
        )
        if (fmt, shape, chunk) != (request.fmt, request.shape, request.chunk_size):
            request = TransferRequest(
                fmt=int(fmt),
                direction=request.direction,
                block_ids=request.block_ids,
                chunk_size=chunk,
                skip_blocks=request.skip_blocks,
                shape=shape,
            )
        return request, layers, objs

    def native_provided(self) -> bool:
        """A native opted in and provided, or a subclass's own :meth:`transfer_kernel`."""
        own = type(self).transfer_kernel is not MluBackend.transfer_kernel
        return own or self.native.get() is not None

    def transfer_kernel(
        self,
        plan: TransferPlan,
        paged: Any,
        objects: Sequence[torch.Tensor],
        torch_kernel: Callable[[], None],
    ) -> Callable[[], None]:
        """Native first when opted in (it may decline), else the torch kernel."""
        return self.native.kernel(plan, paged, objects, torch_kernel, _contiguous_mlu(paged))


def _contiguous_mlu(paged: object) -> Callable[[], bool]:
    def eligible() -> bool:
        layers = paged if isinstance(paged, (list, tuple)) else [paged]
        return all(
            isinstance(t, torch.Tensor) and t.device.type == "mlu" and t.is_contiguous()
            for t in layers
        )

    return eligible
