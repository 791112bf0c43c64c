"""Fake accelerator tensors whose device work runs asynchronously on fake streams.

A :class:`FakeDeviceTensor` is a ``torch.Tensor`` subclass over CPU memory. Metadata and
views run at once; host reads (``cpu``, ``item``, ``equal``...) synchronize first; ``copy_``,
in-place, ``out=`` and tensor-producing ops are enqueued on the current stream (outputs
allocated at once from ``meta`` shapes). Blocking or pageable copies synchronize; the
``strided_d2h_bug`` knob reproduces torch_mlu's async strided D2H. A reader that forgot to
wait sees stale bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from kvactors.testing._device import FakeDevice, parse_fake_device

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.testing._owner import Owner

__all__ = ("FakeDeviceTensor", "move_to", "parse_to", "plain", "wrap")

_NoTF = torch._C.DisableTorchFunctionSubclass

_METADATA_INPLACE = frozenset(
    {
        "set_",
        "resize_",
        "resize_as_",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "swapdims_",
        "swapaxes_",
        "requires_grad_",
        "share_memory_",
        "retain_grad",
        "__set__",
        "_fix_weakref",
        "__setstate__",
    }
)
_HOST_READS = frozenset(
    {
        "cpu",
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__repr__",
        "__str__",
        "__format__",
        "__array__",
        "equal",
        "allclose",
        "__reduce_ex__",
        "__deepcopy__",
        "__dlpack__",
    }
)


class FakeDeviceTensor(torch.Tensor):
    """A tensor on a fake accelerator (CPU memory; device work runs on fake streams)."""

    _fake_vendor: Owner
    _fake_index: int

    @property  # type: ignore[override]
    def device(self) -> torch.device | FakeDevice:  # type: ignore[override]
        """The fake device: ``torch.device("mlu", 0)`` (a :class:`FakeDevice` for a second
        vendor in one process, which cannot have torch devices)."""
        return self._fake_vendor.make_device(self._fake_index)

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        """Always False: this is device memory."""
        return False

    @property
    def is_mlu(self) -> bool:
        """Whether this is a fake MLU tensor."""
        return self._fake_vendor.kind == "mlu"

    @property
    def is_musa(self) -> bool:
        """Whether this is a fake MUSA tensor."""
        return self._fake_vendor.kind == "musa"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


def wrap(t: torch.Tensor, vendor: Owner, index: int) -> FakeDeviceTensor:
    """View ``t`` (a CPU tensor) as a tensor on fake device ``index`` of ``vendor``."""
    with _NoTF():
        out = torch.Tensor._make_subclass(FakeDeviceTensor, t)
    out._fake_vendor = vendor
    out._fake_index = index
    vendor.memory.hold(t.untyped_storage().data_ptr(), out)
    return out


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU alias of a (fake device) tensor's memory; host tensors pass through.

    A detached alias (keeping ``requires_grad``): it shares the memory but not the device
    tensor object, so queued work holding it does not keep the program's tensor alive (the
    allocator statistics free an allocation when the program's last tensor over it goes).
    """
    if isinstance(t, FakeDeviceTensor):
        with _NoTF():
            out = t.detach()
            if t.requires_grad:
                out.requires_grad_()
            return out
    return t


# Ops that only allocate: no kernel runs on a real device.
_NO_KERNEL = frozenset({"new_empty", "new_empty_strided", "empty_like"})


def _name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return "__set__" if name == "__set__" else "get:" + getattr(owner, "__name__", "")
    return str(name)


def _dispatch(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat, _ = pytree.tree_flatten((args, kwargs))
    first = next(x for x in flat if isinstance(x, FakeDeviceTensor))
    vendor, index = first._fake_vendor, first._fake_index
    name = _name(func)

    if name.startswith("get:") or name in _METADATA_INPLACE:
        with _NoTF():
            out = func(*args, **kwargs)
        if name in _METADATA_INPLACE:
            return args[0] if args else out
        return _wrap_all(out, vendor, index)
    if name == "to":
        device, dtype, non_blocking, copy = parse_to(args, kwargs)
        idx = parse_fake_device(device, vendor.kind, vendor.current_device())
        if device is not None and idx is not None:
            return move_to(args[0], vendor, vendor.device_index(idx), dtype, non_blocking, copy)
        if device is None and (dtype is None or dtype == args[0].dtype) and not copy:
            return args[0]
    if name in _HOST_READS or (name == "to" and _targets_cpu(args, kwargs)):
        return _host_read(func, args, kwargs, vendor, index)
    if name == "copy_":
        return _copy(args, kwargs, vendor, index)
    if (
        (name.endswith("_") and not name.startswith("__"))
        or name == "__setitem__"
        or ("out" in kwargs and kwargs["out"] is not None)
    ):
        return _enqueue_mutation(func, args, kwargs, vendor, index)
    return _compute(func, args, kwargs, vendor, index)


def parse_to(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[object, torch.dtype | None, bool, bool]:
    """(device, dtype, non_blocking, copy) of a ``Tensor.to(*args, **kwargs)`` call
    (``args[0]`` is the tensor); device and dtype are None where the call keeps them."""
    device: object = kwargs.get("device")
    dtype: torch.dtype | None = kwargs.get("dtype")
    non_blocking = bool(kwargs.get("non_blocking", False))
    copy = bool(kwargs.get("copy", False))
    rest = list(args[1:])
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest.pop(0)
        device, dtype = other.device, other.dtype
    elif (
        rest
        and isinstance(rest[0], (str, torch.device, FakeDevice, int))
        and not isinstance(rest[0], bool)
    ):
        device = rest.pop(0)
    if rest and isinstance(rest[0], torch.dtype):
        dtype = rest.pop(0)
    if rest:
        non_blocking = bool(rest.pop(0))
    if rest:
        copy = bool(rest.pop(0))
    return device, dtype, non_blocking, copy


def move_to(
    src: torch.Tensor,
    vendor: Owner,
    index: int,
    dtype: torch.dtype | None,
    non_blocking: bool,
    copy: bool,
) -> torch.Tensor:
    """``src.to(<fake device index>, dtype, non_blocking, copy)``, as a vendor runs it.

    Already there (same dtype, no ``copy``): ``src`` itself. A dtype change on the device:
    an asynchronous kernel. From the host or another device: a fresh device tensor filled
    by an emulated copy (asynchronous only for ``non_blocking`` from pinned memory).
    """
    if (
        isinstance(src, FakeDeviceTensor)
        and src._fake_vendor is vendor
        and (src._fake_index == index)
    ):
        if (dtype is None or dtype == src.dtype) and not copy:
            return src
        return _compute(  # type: ignore[no-any-return]
            torch._C.TensorBase.to, (src, dtype or src.dtype), {"copy": True}, vendor, index
        )
    with _NoTF():
        out = torch.empty_like(plain(src), dtype=dtype or src.dtype, device="cpu")
    vendor.memory.add_device(out, index)
    dev = wrap(out, vendor, index)
    _copy((dev, src), {"non_blocking": non_blocking}, vendor, index)
    return dev


def _wrap_all(out: Any, vendor: Owner, index: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out if isinstance(out, FakeDeviceTensor) else wrap(out, vendor, index)
    if isinstance(out, torch.Size) or not isinstance(out, (tuple, list, dict)):
        return out  # metadata (shape, dtype...) keeps its type: pytree would make a tuple

    def w(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor):
            return wrap(x, vendor, index)
        return x

    return pytree.tree_map(w, out)


def _unwrap(tree: Any, *, snapshot_host: bool, keep: tuple[object, ...] = ()) -> Any:
    def u(x: Any) -> Any:
        if isinstance(x, FakeDeviceTensor):
            return plain(x)
        if snapshot_host and isinstance(x, torch.Tensor) and not any(x is k for k in keep):
            with _NoTF():
                return x.clone()
        return x

    return pytree.tree_map(u, tree)


def _count_uploads(vendor: Owner, tree: Any, keep: tuple[object, ...]) -> None:
    """Count host tensors handed to a device kernel as implicit synchronous uploads."""
    for x in pytree.tree_flatten(tree)[0]:
        if (
            isinstance(x, torch.Tensor)
            and not isinstance(x, FakeDeviceTensor)
            and x.dim() > 0
            and not any(x is k for k in keep)
        ):
            vendor.tally.add("h2d")
            vendor.tally.add("syncs")


def _targets_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for x in (*args[1:], kwargs.get("device")):
        if isinstance(x, torch.device) and x.type == "cpu":
            return True
        if isinstance(x, str) and x.split(":")[0] == "cpu":
            return True
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor):
            return True
    return False


def _host_read(func: Callable[..., Any], args: Any, kwargs: Any, vendor: Owner, index: int) -> Any:
    vendor.current_stream(index).synchronize()
    pa, pk = _unwrap((args, kwargs), snapshot_host=False)
    with _NoTF():
        return func(*pa, **pk)


def _copy(args: tuple[Any, ...], kwargs: dict[str, Any], vendor: Owner, index: int) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    src_dev, dst_dev = isinstance(src, FakeDeviceTensor), isinstance(dst, FakeDeviceTensor)
    if src_dev:
        index = src._fake_index
    stream = vendor.current_stream(index)
    pd, ps = plain(dst), plain(src)
    cfg = vendor.knobs

    def run() -> None:
        pd.copy_(ps)

    tally = vendor.tally
    if src_dev and not dst_dev:  # device to host
        tally.add("d2h")
        converting = pd.dtype != ps.dtype or not pd.is_contiguous() or pd.stride() != ps.stride()
        if non_blocking and converting and cfg.strided_d2h_bug:
            staging = torch.zeros(ps.shape, dtype=ps.dtype)
            pd.copy_(staging)  # the host reads the zeroed staging before the DMA lands
            stream.enqueue(lambda: staging.copy_(ps))  # ...which fills a buffer nobody reads
            return dst
        stream.enqueue(run)
        if not non_blocking or not (cfg.pageable_async or vendor.memory.is_pinned(pd)):
            stream.synchronize()
    elif dst_dev and not src_dev:  # host to device
        tally.add("h2d")
        stream.enqueue(run)
        if not non_blocking or not (cfg.pageable_async or vendor.memory.is_pinned(ps)):
            stream.synchronize()
    else:  # device to device: a kernel, asynchronous regardless of non_blocking
        tally.add("d2d")
        tally.add("launches")
        stream.enqueue(run)
    return dst


def _enqueue_mutation(
    func: Callable[..., Any], args: Any, kwargs: Any, vendor: Owner, index: int
) -> Any:
    target = kwargs["out"] if kwargs.get("out") is not None else args[0]
    keep = tuple(pytree.tree_flatten(target)[0])
    pa, pk = _unwrap((args, kwargs), snapshot_host=True, keep=keep)
    _count_uploads(vendor, (args, kwargs), keep)
    vendor.tally.add("launches")
    vendor.current_stream(index).enqueue(lambda: func(*pa, **pk))
    return target


def _is_alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        with _NoTF():
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def _compute(func: Callable[..., Any], args: Any, kwargs: Any, vendor: Owner, index: int) -> Any:
    margs, mkwargs = pytree.tree_map(_to_meta, (args, kwargs))
    try:
        with _NoTF():
            mout = func(*margs, **mkwargs)
    except Exception:
        vendor.current_stream(index).synchronize()
        pa, pk = _unwrap((args, kwargs), snapshot_host=False)
        with _NoTF():
            out = func(*pa, **pk)
        for r in pytree.tree_flatten(out)[0]:
            if isinstance(r, torch.Tensor):
                vendor.memory.add_device(r, index)
        vendor.tally.add("launches")
        return _wrap_all(out, vendor, index)
    mflat, spec = pytree.tree_flatten(mout)
    mtensors = [t for t in mflat if isinstance(t, torch.Tensor)]
    if not mtensors:  # metadata answer (size, data_ptr, ...): ask the real tensors
        pa, pk = _unwrap((args, kwargs), snapshot_host=False)
        with _NoTF():
            return func(*pa, **pk)
    if any(t.device.type != "meta" for t in mtensors):
        return _host_read(func, args, kwargs, vendor, index)
    minputs = [t for t in pytree.tree_flatten((margs, mkwargs))[0] if isinstance(t, torch.Tensor)]
    if any(_is_alias(o, i) for o in mtensors for i in minputs):  # a view
        pa, pk = _unwrap((args, kwargs), snapshot_host=False)
        with _NoTF():
            return _wrap_all(func(*pa, **pk), vendor, index)
    outs: list[Any] = []
    fresh: list[torch.Tensor] = []
    for m in mflat:
        if isinstance(m, torch.Tensor):
            t = torch.empty_strided(m.size(), m.stride(), dtype=m.dtype)
            vendor.memory.add_device(t, index)
            fresh.append(t)
            outs.append(wrap(t, vendor, index))
        else:
            outs.append(m)
    pa, pk = _unwrap((args, kwargs), snapshot_host=True)
    _count_uploads(vendor, (args, kwargs), ())
    if _name(func) not in _NO_KERNEL:
        vendor.tally.add("launches")

    def run() -> None:
        res = [r for r in pytree.tree_flatten(func(*pa, **pk))[0] if isinstance(r, torch.Tensor)]
        for dst, r in zip(fresh, res, strict=True):
            dst.copy_(r)

    vendor.current_stream(index).enqueue(run)
    return pytree.tree_unflatten(outs, spec)
