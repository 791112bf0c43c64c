"""MUSA cache context: pointer tables, one staging buffer, and a safe close order.

Theory of operation. A context describes one engine's paged KV memory on one MUSA device for
many transfers: per kernel group (the layer list, or the K list and the V list of a K/V-list
layout) a packed int64 device tensor of layer pointers, in wire order; and one staging buffer
of raw bytes from which typed views are cut on demand (every view aliases the same bytes, so
at most one transfer uses the staging at a time: the owning StreamActor serialises them).
IPC owners whose views the groups are may be handed over too.

Close order is the contract (lmcache-contract.md section 7, invariant 7): synchronize the
stream that used the views, then drop every view (pointer tables, staging views, layer
tensors), then close each IPC owner, always (in ``finally``, each one even if an earlier one
failed). A second ``close`` is a no-op. The first failure is re-raised after everything ran.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvactors.errors import IPCError, TransferValidationError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvactors.devices.base import Backend, IPCOwner, StreamLike

__all__ = ("MusaCacheContext",)


class MusaCacheContext:
    """Paged KV pointer tables and a staging buffer on one MUSA device.

    Args:
        backend: the backend (``synchronize`` is used on close).
        stream: the stream transfers using this context run on.
        index: the device index.
        groups: per kernel group, the layer tensors (wire order; K before V).
        staging_nbytes: size of the staging buffer in bytes.
        owners: IPC owners backing the layer tensors, closed last.
    """

    def __init__(
        self,
        backend: Backend,
        stream: StreamLike,
        index: int,
        groups: Sequence[Sequence[torch.Tensor]],
        *,
        staging_nbytes: int,
        owners: Sequence[IPCOwner] = (),
    ) -> None:
        if not groups or any(not g for g in groups):
            raise TransferValidationError("every kernel group needs at least one layer",
                                          field="groups")
        for g in groups:
            for t in g:
                if not backend.is_device_tensor(t, index):
                    raise TransferValidationError(
                        f"layer tensor on {t.device}, expected {backend.kind}:{index}",
                        field="groups",
                    )
        if staging_nbytes <= 0:
            raise TransferValidationError("staging_nbytes must be positive", field="staging")
        self._backend = backend
        self._stream = stream
        self.index = index
        device = backend.device(index)
        self.groups: list[list[torch.Tensor]] = [list(g) for g in groups]
        self.pointer_tables: list[torch.Tensor] = [
            torch.tensor([t.data_ptr() for t in g], dtype=torch.int64, device=device)
            for g in groups
        ]
        self._staging: torch.Tensor | None = torch.empty(
            staging_nbytes, dtype=torch.uint8, device=device
        )
        self.staging_nbytes = staging_nbytes
        self._views: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._owners = list(owners)
        self.closed = False

    def staging_view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed view of the start of the staging buffer (cached per dtype and shape)."""
        if self._staging is None:
            raise IPCError("MUSA cache context is closed")
        key = (dtype, tuple(int(n) for n in shape))
        view = self._views.get(key)
        if view is None:
            need = math.prod(key[1]) * dtype.itemsize
            if need > self.staging_nbytes:
                raise TransferValidationError(
                    f"staging view needs {need} bytes, buffer has {self.staging_nbytes}",
                    field="staging",
                )
            view = self._staging[:need].view(dtype).view(key[1])
            self._views[key] = view
        return view

    def close(self) -> None:
        """Sync the stream, drop every view, close every IPC owner; idempotent."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []
        try:
            self._backend.synchronize(self._stream)
        except Exception as exc:
            errors.append(exc)
        finally:
            self._views.clear()
            self.pointer_tables = []
            self.groups = []
            self._staging = None
            for owner in self._owners:
                try:
                    owner.close()
                except Exception as exc:
                    errors.append(exc)
            self._owners = []
        if errors:
            raise errors[0]
