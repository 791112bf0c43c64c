"""Native transfer kernels: the extension point for vendor fast paths (MUSA, MLU).

A native transfer is a zero-argument factory registered in the entry-point group
:data:`ENTRY_POINT_GROUP` under the backend kind (or passed as ``MusaBackend(native=...)``).
It runs only when opted in (MUSA ``LMCACHE_MUSA_NATIVE_KV_TRANSFER=1``, MLU
``KVACTORS_MLU_NATIVE_KV_TRANSFER=1``) and the backend finds the plan eligible, on the lane
thread after validation: ``transfer(plan, paged, objects)`` enqueues the whole copy and
returns True, or declines before enqueueing anything (False or
:class:`~kvactors.errors.UnsupportedOperationError`) and kvactors' torch kernel runs. Any other
exception fails the transfer.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from typing import TYPE_CHECKING, Protocol, final

from kvactors.errors import UnsupportedOperationError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import torch

    from kvactors.core.plans import TransferPlan

__all__ = (
    "ENTRY_POINT_GROUP",
    "NativeCounters",
    "NativeKvTransfer",
    "NativeSlot",
    "load_native",
    "with_native",
)

ENTRY_POINT_GROUP = "kvactors.native_kernels"

_log = logging.getLogger(__name__)


class NativeKvTransfer(Protocol):
    """A native block transfer for one device kind."""

    def transfer(self, plan: TransferPlan, paged: object, objects: Sequence[torch.Tensor]) -> bool:
        """Enqueue the whole planned copy on the current stream and return True, or decline
        (return False, or raise UnsupportedOperationError) before enqueueing anything."""
        ...


@final
class NativeCounters:
    """How many transfers the native ran and how many it declined (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.native_transfers = 0
        self.native_declined = 0

    def count(self, ran: bool) -> None:
        """Count one native run (``ran``) or one decline."""
        with self._lock:
            if ran:
                self.native_transfers += 1
            else:
                self.native_declined += 1


def load_native(kind: str) -> NativeKvTransfer | None:
    """The native registered for ``kind`` in :data:`ENTRY_POINT_GROUP`, or None.

    A registration that fails to load is logged and ignored (the torch path runs).
    """
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=kind):
        try:
            native = ep.load()()
        except Exception as exc:
            _log.warning("native kernel %s (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if callable(getattr(native, "transfer", None)):
            return native  # type: ignore[no-any-return]
        _log.warning("native kernel %s (%s) has no transfer() method", ep.name, ep.value)
    return None


def with_native(
    native: NativeKvTransfer,
    plan: TransferPlan,
    paged: object,
    objects: Sequence[torch.Tensor],
    torch_kernel: Callable[[], None],
    counters: NativeCounters,
) -> Callable[[], None]:
    """A kernel that tries ``native`` and falls back to ``torch_kernel`` when it declines."""

    def kernel() -> None:
        try:
            ran = bool(native.transfer(plan, paged, objects))
        except UnsupportedOperationError:
            ran = False
        counters.count(ran)
        if not ran:
            torch_kernel()

    return kernel


_TRUE = frozenset({"1", "true", "yes", "on"})


@final
class NativeSlot:
    """A backend's native transfer: opt-in flag, injected or registered native, counters.

    Args:
        kind: The backend kind (the entry-point name looked up).
        opt_in_env: The variable that must be 1/true/yes/on for any native to run.
        native: An injected native (used instead of the entry point), or None.
        env: Where to read the opt-in (default ``os.environ``, read at first use).
    """

    def __init__(
        self,
        kind: str,
        opt_in_env: str,
        native: NativeKvTransfer | None,
        env: Mapping[str, str],
    ) -> None:
        self.kind = kind
        self.opt_in_env = opt_in_env
        self._injected = native
        self._env = env
        self._lock = threading.Lock()
        self._resolved = False
        self._native: NativeKvTransfer | None = None
        self.counters = NativeCounters()

    @property
    def opted_in(self) -> bool:
        """Whether the opt-in variable is on."""
        return self._env.get(self.opt_in_env, "").strip().lower() in _TRUE

    def get(self) -> NativeKvTransfer | None:
        """The native to try, or None (not opted in, or none provided); resolved once."""
        if self._resolved:  # set after _native: a reader that sees it sees the native too
            return self._native
        with self._lock:
            if not self._resolved:
                if self.opted_in:
                    self._native = self._injected or load_native(self.kind)
                self._resolved = True
            return self._native

    def kernel(
        self,
        plan: TransferPlan,
        paged: object,
        objects: Sequence[torch.Tensor],
        torch_kernel: Callable[[], None],
        eligible: Callable[[], bool],
    ) -> Callable[[], None]:
        """``torch_kernel``, or a native-first kernel when a native exists and ``eligible()``."""
        native = self.get()
        if native is None or not eligible():
            return torch_kernel
        return with_native(native, plan, paged, objects, torch_kernel, self.counters)
