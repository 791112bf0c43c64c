"""MUSA transfer contract (pure): supported layouts, dtypes, pointer operands, capabilities.

Decides before any copy whether a MUSA transfer may run, as LMCache's MUSA path does: three
layouts (per-layer ``[2, NB, BS, NH, HS]``, MLA ``[NB, BS, HS]``, K/V lists), an exact dtype
(2 bytes is never guessed), 1-D int64/uint64 pointer operands, and probed capabilities (handle
mode needs ``LMCACHE_MUSA_HANDLE_TRANSFER`` plus memory and event IPC).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.errors import OperandTypeError, TransferValidationError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = (
    "HANDLE_TRANSFER_ENV",
    "MUSA_MP_FORMATS",
    "MUSA_NATIVE_FORMATS",
    "NATIVE_TRANSFER_ENV",
    "MusaCapabilities",
    "check_format",
    "check_pointer_tensor",
    "env_flag",
    "event_ipc_problem",
    "exact_dtype",
    "group_pointers",
    "memory_ipc_problem",
    "paged_view_geometry",
    "probe_capabilities",
)

HANDLE_TRANSFER_ENV = "LMCACHE_MUSA_HANDLE_TRANSFER"
NATIVE_TRANSFER_ENV = "LMCACHE_MUSA_NATIVE_KV_TRANSFER"
MUSA_MP_FORMATS = frozenset(
    {KVFormat.NL_X_TWO_NB_BS_NH_HS, KVFormat.NL_X_NB_BS_HS, KVFormat.TWO_X_NL_X_NB_BS_NH_HS}
)
MUSA_NATIVE_FORMATS = frozenset({KVFormat.NL_X_TWO_NB_BS_NH_HS, KVFormat.NL_X_NB_BS_HS})
_TRUE = frozenset({"1", "true", "yes", "on"})
_BY_SIZE = {1: torch.uint8, 4: torch.float32}


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """Whether ``env[name]`` is one of 1/true/yes/on (case-insensitive)."""
    return env.get(name, "").strip().lower() in _TRUE


def check_format(fmt: int) -> KVFormat:
    """The format, if MUSA block transfer supports it; else TransferValidationError."""
    if not isinstance(fmt, bool) and isinstance(fmt, int) and fmt in MUSA_MP_FORMATS:
        return KVFormat(fmt)
    names = ", ".join(f"{f.name} ({int(f)})" for f in sorted(MUSA_MP_FORMATS))
    raise TransferValidationError(
        f"MUSA MP block transfer supports only {names}; got format {fmt!r}", field="fmt"
    )


def exact_dtype(element_size: int, dtype: str | torch.dtype | None) -> torch.dtype:
    """The operand dtype: the exact one when given, else inferred for 1 or 4 bytes only.

    Raises:
        TransferValidationError: 2-byte (or other) sizes without an exact dtype, an unknown
            dtype name, or a dtype whose size disagrees with ``element_size``.
    """
    if dtype is not None:
        dt = (
            dtype
            if isinstance(dtype, torch.dtype)
            else getattr(torch, str(dtype).removeprefix("torch."), None)
        )
        if not isinstance(dt, torch.dtype):
            raise TransferValidationError(f"unknown dtype {dtype!r}", field="dtype")
        if dt.itemsize != element_size:
            raise TransferValidationError(
                f"dtype {dt} has {dt.itemsize} bytes but element_size is {element_size}",
                field="dtype",
            )
        return dt
    if element_size in _BY_SIZE:
        return _BY_SIZE[element_size]
    raise TransferValidationError(
        f"element_size {element_size} without an exact shape_desc.dtype is ambiguous "
        "(float16 or bfloat16?); pass the exact shape_desc.dtype",
        field="dtype",
    )


def paged_view_geometry(fmt: int, shape: ShapeDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, stride) in elements of the per-pointer paged view for a MUSA format.

    Padded blocks use ``shape.block_stride_elems`` as the block-axis stride (never assumed
    tight).
    """
    f = check_format(fmt)
    nb, bs, nh, hs = shape.nb, shape.bs, shape.nh, shape.hs
    if f is KVFormat.NL_X_NB_BS_HS:
        block = shape.block_stride_elems or bs * hs
        return (nb, bs, hs), (block, hs, 1)
    block = shape.block_stride_elems or bs * nh * hs
    if f is KVFormat.NL_X_TWO_NB_BS_NH_HS:
        return (2, nb, bs, nh, hs), (nb * block, block, nh * hs, hs, 1)
    return (nb, bs, nh, hs), (block, nh * hs, hs, 1)


def check_pointer_tensor(ptrs: object, fmt: int, nl: int) -> tuple[int, ...]:
    """Validate a packed pointer operand and return its pointers (wire order).

    Raises:
        OperandTypeError: not a 1-D int64/uint64 tensor.
        TransferValidationError: wrong count (NL, or 2*NL for K/V lists) or a null pointer.
    """
    f = check_format(fmt)
    if (
        not isinstance(ptrs, torch.Tensor)
        or ptrs.dim() != 1
        or ptrs.dtype
        not in (
            torch.int64,
            torch.uint64,
        )
    ):
        raise OperandTypeError("pointer operand must be a 1-D int64/uint64 tensor", field="ptrs")
    want = 2 * nl if f is KVFormat.TWO_X_NL_X_NB_BS_NH_HS else nl
    if ptrs.numel() != want:
        raise TransferValidationError(
            f"expected {want} pointers for format {f.name} with nl={nl}, got {ptrs.numel()}",
            field="ptrs",
        )
    values = tuple(int(p) for p in ptrs.cpu().tolist())
    if any(p <= 0 for p in values):
        raise TransferValidationError("pointer operand holds a null pointer", field="ptrs")
    return values


def group_pointers(ptrs: Sequence[int], fmt: int, nl: int) -> list[list[int]]:
    """Per-kernel-group pointers: K/V lists ``[K_0..K_{NL-1}, V_0..]`` -> ``[[K...], [V...]]``."""
    f = check_format(fmt)
    if f is KVFormat.TWO_X_NL_X_NB_BS_NH_HS:
        if len(ptrs) != 2 * nl:
            raise TransferValidationError(f"K/V list needs {2 * nl} pointers", field="ptrs")
        return [list(ptrs[:nl]), list(ptrs[nl:])]
    if len(ptrs) != nl:
        raise TransferValidationError(f"expected {nl} pointers", field="ptrs")
    return [list(ptrs)]


class MusaCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What this torch_musa build (and environment) allows."""

    memory_ipc: bool
    event_ipc: bool
    handle_opt_in: bool
    problems: tuple[str, ...] = ()

    @property
    def handle_mode(self) -> bool:
        """LMCache-driven (IPC handle) mode: opt-in, memory IPC and event IPC all hold."""
        return self.handle_opt_in and self.memory_ipc and self.event_ipc


def memory_ipc_problem(module: object) -> str:
    """Why ``module.ipc`` cannot export/open tensors; empty when it can."""
    ipc = getattr(module, "ipc", None)
    if ipc is None:
        return "torch.musa.ipc is missing (this torch_musa has no tensor IPC)"
    for name in ("export_tensor", "open_tensor"):
        if not callable(getattr(ipc, name, None)):
            return f"torch.musa.ipc.{name} is missing"
    if not callable(getattr(getattr(ipc, "MUSAIPCTensorHandle", None), "from_dict", None)):
        return "torch.musa.ipc.MUSAIPCTensorHandle.from_dict is missing"
    return ""


def _accepts_interprocess(event_cls: Any) -> bool:
    try:
        params = inspect.signature(event_cls).parameters
        if "interprocess" in params:
            return True
    except (TypeError, ValueError):
        pass
    try:
        event_cls(interprocess=True)
    except Exception:
        return False
    return True


def event_ipc_problem(module: object) -> str:
    """Why ``module.Event`` cannot do interprocess events; empty when it can."""
    ev = getattr(module, "Event", None)
    if ev is None:
        return "torch.musa.Event is missing"
    if not callable(getattr(ev, "from_ipc_handle", None)):
        return "torch.musa.Event.from_ipc_handle is missing"
    for name in ("ipc_handle", "record", "wait", "query", "synchronize"):
        if not callable(getattr(ev, name, None)):
            return f"torch.musa.Event.{name} is missing"
    if not _accepts_interprocess(ev):
        return "torch.musa.Event does not accept interprocess=True"
    return ""


def probe_capabilities(module: object, env: Mapping[str, str]) -> MusaCapabilities:
    """Probe memory IPC, event IPC and the opt-ins; never raises."""
    mem = memory_ipc_problem(module)
    ev = event_ipc_problem(module)
    opt_in = env_flag(env, HANDLE_TRANSFER_ENV)
    problems = [p for p in (mem, ev) if p]
    if not opt_in:
        problems.append(f"{HANDLE_TRANSFER_ENV} is not set (handle mode is opt-in)")
    return MusaCapabilities(
        memory_ipc=not mem,
        event_ipc=not ev,
        handle_opt_in=opt_in,
        problems=tuple(problems),
    )
