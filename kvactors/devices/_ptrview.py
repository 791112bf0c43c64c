"""Non-owning views of process-local device memory from a raw pointer.

Theory of operation. A pointer is validated first
(:func:`kvactors.core.pointers.check_view_request`),
then wrapped without copying: ``torch._C._construct_storage_from_data_pointer(ptr, device,
nbytes)`` makes a storage with no deleter (the caller keeps the allocation alive), and either
the vendor's tensor-from-storage constructor or ``torch.empty(0, device=...).set_(storage,
offset, size, stride)`` puts the view on it. ``set_`` also runs the vendor's per-tensor setup,
which a bare constructor may skip. Both entry points are probed with ``getattr``: neither is
public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvactors.core.pointers import check_view_request
from kvactors.devices._vendor import device_errors
from kvactors.errors import InvalidPointerError, UnsupportedOperationError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("StorageConstructor", "view_from_pointer")


class StorageConstructor(Protocol):
    """A vendor ``_construct_<DEV>_Tensor_From_Storage_And_Metadata(metadata, storage)``."""

    def __call__(self, metadata: dict[str, Any], storage: Any, /) -> torch.Tensor: ...


def view_from_pointer(
    ptr: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    backend: str,
    stride: Sequence[int] | None = None,
    storage_offset: int = 0,
    nbytes: int | None = None,
    constructor: StorageConstructor | None = None,
) -> torch.Tensor:
    """A validated, non-owning view of ``nbytes`` at ``ptr`` on ``device``.

    Raises:
        InvalidPointerError: a bad pointer, shape, stride, offset, dtype or byte count.
        UnsupportedOperationError: this torch cannot wrap raw pointers.
        DeviceOpError: the runtime refused the pointer.
    """
    if not isinstance(dtype, torch.dtype):
        raise InvalidPointerError(f"dtype must be a torch.dtype, got {dtype!r}", field="dtype")
    req = check_view_request(
        ptr,
        shape,
        dtype.itemsize,
        stride=stride,
        storage_offset=storage_offset,
        available_nbytes=nbytes,
    )
    if req.nbytes == 0:
        return torch.empty(req.shape, dtype=dtype, device=device)
    make_storage = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make_storage is None:
        raise UnsupportedOperationError(
            "this torch lacks torch._C._construct_storage_from_data_pointer", backend=backend
        )
    with device_errors(str(device), "tensor_from_ptr"):
        storage = make_storage(req.ptr, device, req.nbytes)
        if constructor is not None:
            meta = {
                "dtype": dtype,
                "size": req.shape,
                "stride": req.stride,
                "storage_offset": req.storage_offset,
                "device": device,
            }
            return constructor(meta, storage)
        view = torch.empty(0, dtype=dtype, device=device)
        return view.set_(storage, req.storage_offset, req.shape, req.stride)
