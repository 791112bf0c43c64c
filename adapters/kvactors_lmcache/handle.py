"""The MUSA handle (LMCache-driven) path, as far as LMCache 0.5.6 lets a plugin go.

On this path LMCache's server calls the ops with raw device pointers, and its IPC wire ships
only LMCache's own wrappers, so kvactors reuses ``MusaIPCWrapper`` and ``MUSACacheContext``.
The context made here registers the exact tensors behind those pointers in a process-local
:class:`PointerRegistry`; the MUSA ops accept pointers only when every one resolves there
(else ``TypeError``). ``close()`` unregisters first, then syncs, drops views, closes owners.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ("REGISTRY", "PointerRegistry", "create_musa_cache_context", "tensor_leaves")


def tensor_leaves(value: object) -> list[torch.Tensor]:
    """Every tensor in a tensor / (nested) list / tuple structure, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensor_leaves(item)]
    return []


class PointerRegistry:
    """Process-local map from a registered tensor's ``data_ptr()`` to the tensor itself.

    Only cache contexts built by this adapter register; the registry holds strong references
    until :meth:`unregister`, which the context calls before it releases its IPC owners.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, list[torch.Tensor]] = {}
        self._by_ptr: dict[int, torch.Tensor] = {}
        self._ids = itertools.count(1)

    def register(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register ``tensors``; returns the token for :meth:`unregister`."""
        ts = [t for t in tensors if t.data_ptr() != 0]
        with self._lock:
            token = next(self._ids)
            self._owners[token] = ts
            for t in ts:
                self._by_ptr[t.data_ptr()] = t
            return token

    def unregister(self, token: int) -> None:
        """Forget the tensors of ``token``; idempotent."""
        with self._lock:
            for t in self._owners.pop(token, []):
                if self._by_ptr.get(t.data_ptr()) is t:
                    del self._by_ptr[t.data_ptr()]

    def resolve(self, ptr: int) -> torch.Tensor | None:
        """The registered tensor starting at ``ptr``, or ``None``."""
        with self._lock:
            return self._by_ptr.get(int(ptr))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_ptr)


REGISTRY = PointerRegistry()


@functools.cache
def _context_class() -> type[Any]:
    # Built once (lmcache's MUSA module is imported lazily): every context is an instance of
    # the same class.
    from lmcache.v1.platform.devices.musa.cache_context import MUSACacheContext

    class KvactorsMusaCacheContext(MUSACacheContext):  # type: ignore[misc, valid-type]
        """LMCache's MUSA cache context whose device pointers kvactors can resolve."""

        _kvactors_token: int | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            views: list[torch.Tensor] = tensor_leaves(list(self.kv_caches_))
            groups = int(self.kv_layer_groups_manager.num_kernel_groups)
            for b in range(int(self.max_batch_size)):
                for g in range(groups):
                    views.append(self.get_temp_kernel_group_buffer(b, g))
            self._kvactors_token = REGISTRY.register(views)

        def close(self) -> None:
            token = self._kvactors_token
            self._kvactors_token = None
            if token is not None:
                REGISTRY.unregister(token)
            super().close()

    return KvactorsMusaCacheContext


def create_musa_cache_context(*args: Any, **kwargs: Any) -> Any:
    """Build the server-side MUSA cache context (LMCache's positional arguments, verbatim)."""
    return _context_class()(*args, **kwargs)
