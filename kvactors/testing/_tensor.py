"""Fake accelerator tensors whose device work runs asynchronously on fake streams.

A :class:`FakeDeviceTensor` is a ``torch.Tensor`` subclass over CPU memory. Metadata and
views run at once; host reads (``cpu``, ``item``, ``equal``...) synchronize first; ``copy_``,
in-place, ``out=`` and tensor-producing ops are enqueued on the current stream (outputs
allocated at once from ``meta`` shapes). Blocking or pageable copies synchronize; the
``strided_d2h_bug`` knob reproduces torch_mlu's async strided D2H. A reader that forgot to
wait sees stale bytes.

Dispatch is a table: the first call of a torch function resolves, from its name, the handler
that runs it (``_HANDLERS``), and later calls go straight to it. Names whose answer never
depends on the arguments have their own handlers (metadata queries, views, basic indexing);
everything else takes the general path, which asks the ``meta`` device what the call
produces, every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from kvactors.testing._device import FakeDevice, parse_fake_device

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.testing._owner import Owner

    Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

__all__ = ("FakeDeviceTensor", "move_to", "parse_to", "plain", "wrap")

_NoTF = torch._C.DisableTorchFunctionSubclass
_is_alias_of = torch._C._is_alias_of  # type: ignore[attr-defined]
# torch's own factory: a fake installs a wrapper over ``torch.empty_strided``.
_empty_strided = torch._C._VariableFunctions.empty_strided

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
# Queries of a tensor's metadata: a number (or the storage) for any arguments, never a tensor,
# and no device work (the general path would find that out on ``meta`` every call).
_METADATA = frozenset(
    {
        "size",
        "stride",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "storage_offset",
        "data_ptr",
        "untyped_storage",
        "is_contiguous",
        "is_inference",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "get_device",
        "__len__",
    }
)
# Views of their first argument for any arguments (``reshape``, ``contiguous``, ``flatten``
# and indexing copy for some arguments, so they are not here).
_VIEWS = frozenset(
    {
        "view",
        "view_as",
        "as_strided",
        "select",
        "narrow",
        "permute",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "diagonal",
        "movedim",
        "moveaxis",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "unfold",
        "detach",
        "alias",
    }
)
# Ops that only allocate: no kernel runs on a real device.
_NO_KERNEL = frozenset({"new_empty", "new_empty_strided", "empty_like"})
# Distinct torch functions seen are few (the API's size); the bound only guards against
# callables made per call.
_MEMO_LIMIT = 4096


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
        try:
            handler = _HANDLERS[func]
        except (KeyError, TypeError):
            handler = _handler_of(func)
        return handler(func, args, kwargs or {})


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


# ---- argument trees (what torch's pytree walks, without its per-call cost) ---------------

_NODES = (tuple, list, dict)


def _leaves(tree: Any, out: list[Any]) -> list[Any]:
    """Append the pytree leaves of ``tree`` to ``out``: plain tuples, lists and dicts are
    walked here, any other container by pytree (its order: depth first, dicts by insertion)."""
    tp = type(tree)
    if tp is tuple or tp is list or tp is dict:
        for x in tree.values() if tp is dict else tree:
            if isinstance(x, _NODES):
                _leaves(x, out)
            else:
                out.append(x)
    elif isinstance(tree, _NODES):
        out.extend(pytree.tree_leaves(tree))
    else:
        out.append(tree)
    return out


def _map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to its tensors (``pytree.tree_map`` for tensor leaves)."""
    tp = type(tree)
    if tp is tuple or tp is list:
        out = []
        for x in tree:
            if isinstance(x, torch.Tensor):
                out.append(fn(x))
            elif isinstance(x, _NODES):
                out.append(_map_tensors(fn, x))
            else:
                out.append(x)
        return tuple(out) if tp is tuple else out
    if tp is dict:
        res = {}
        for k, x in tree.items():
            if isinstance(x, torch.Tensor):
                res[k] = fn(x)
            elif isinstance(x, _NODES):
                res[k] = _map_tensors(fn, x)
            else:
                res[k] = x
        return res
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, _NODES) and tp is not torch.Size:
        return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)
    return tree


def _first_fake(args: tuple[Any, ...], kwargs: dict[str, Any]) -> FakeDeviceTensor:
    if args and isinstance(args[0], FakeDeviceTensor):
        return args[0]
    for x in _leaves((args, kwargs), []):
        if isinstance(x, FakeDeviceTensor):
            return x
    raise TypeError("a fake device tensor's dispatch got no fake device tensor")


# ---- the dispatch table: one handler per torch function, resolved on its first call ------

_HANDLERS: dict[Callable[..., Any], Handler] = {}


def _name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return "__set__" if name == "__set__" else "get:" + getattr(owner, "__name__", "")
    return str(name)


def _handler_of(func: Callable[..., Any]) -> Handler:
    """Resolve (and remember, where ``func`` is hashable) the handler of ``func``."""
    handler = _resolve(_name(func))
    try:
        if len(_HANDLERS) < _MEMO_LIMIT:
            _HANDLERS[func] = handler
    except TypeError:  # an unhashable callable: resolved on every call
        pass
    return handler


def _resolve(name: str) -> Handler:
    """The handler of the torch function called ``name`` (what it does never depends on
    the call, or the handler looks at the call)."""
    if name.startswith("get:"):
        return _get
    if name in _METADATA_INPLACE:
        return _metadata_inplace
    if name == "to":
        return _to
    if name in _HOST_READS:
        return _host_read_op
    if name == "copy_":
        return _copy_op
    if (name.endswith("_") and not name.startswith("__")) or name == "__setitem__":
        return _mutation_op
    if name in _METADATA:
        return _metadata
    if name in _VIEWS:
        return _view
    if name == "__getitem__":
        return _getitem
    return _general


def _get(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A property (``shape``, ``dtype``, ``T``...): at once; tensors stay on the device."""
    with _NoTF():
        out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor) or (
        isinstance(out, _NODES) and not isinstance(out, torch.Size)
    ):
        first = _first_fake(args, kwargs)
        return _wrap_all(out, first._fake_vendor, first._fake_index)
    return out


def _metadata_inplace(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An in-place change of metadata only (``set_``, ``squeeze_``...): at once."""
    with _NoTF():
        out = func(*args, **kwargs)
    return args[0] if args else out


def _to(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = _first_fake(args, kwargs)
    vendor = first._fake_vendor
    device, dtype, non_blocking, copy = parse_to(args, kwargs)
    idx = parse_fake_device(device, vendor.kind, vendor.current_device())
    if device is not None and idx is not None:
        return move_to(args[0], vendor, vendor.device_index(idx), dtype, non_blocking, copy)
    if device is None and (dtype is None or dtype == args[0].dtype) and not copy:
        return args[0]
    if _targets_cpu(args, kwargs):
        return _host_read(func, args, kwargs, vendor, first._fake_index)
    return _general(func, args, kwargs)


def _host_read_op(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = _first_fake(args, kwargs)
    return _host_read(func, args, kwargs, first._fake_vendor, first._fake_index)


def _copy_op(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = _first_fake(args, kwargs)
    return _copy(args, kwargs, first._fake_vendor, first._fake_index)


def _mutation_op(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = _first_fake(args, kwargs)
    return _enqueue_mutation(func, args, kwargs, first._fake_vendor, first._fake_index)


def _general(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Any other function: ``out=`` is a queued mutation, the rest is computed."""
    first = _first_fake(args, kwargs)
    vendor, index = first._fake_vendor, first._fake_index
    if kwargs.get("out") is not None:
        return _enqueue_mutation(func, args, kwargs, vendor, index)
    return _compute(func, args, kwargs, vendor, index)


def _metadata(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A metadata query (``size``, ``data_ptr``...): answered by the memory at once.

    A call the query rejects takes the general path, which raises as it did.
    """
    if "out" in kwargs:
        return _general(func, args, kwargs)
    try:
        with _NoTF():
            return func(*args, **kwargs)
    except Exception:
        return _general(func, args, kwargs)


def _view(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view of the first argument (``view``, ``select``, ``as_strided``...): at once.

    Anything else (an argument it rejects, a result that does not alias the input) takes
    the general path, which asks ``meta`` and raises or computes as it did.
    """
    base = args[0] if args else None
    if isinstance(base, FakeDeviceTensor) and "out" not in kwargs:
        pbase = plain(base)
        try:
            with _NoTF():
                out = func(pbase, *_map_tensors(plain, args[1:]), **kwargs)
        except Exception:
            out = None
        if _all_alias(out, pbase):
            return _wrap_all(out, base._fake_vendor, base._fake_index)
    return _general(func, args, kwargs)


def _all_alias(out: Any, base: torch.Tensor) -> bool:
    if isinstance(out, torch.Tensor):
        return bool(_is_alias_of(out, base))
    if type(out) is tuple or type(out) is list:
        return all(isinstance(o, torch.Tensor) and _is_alias_of(o, base) for o in out)
    return False


def _basic_index(index: Any) -> bool:
    """Whether ``t[index]`` is basic indexing (a view): ints, slices of ints, None, ``...``."""
    items = index if type(index) is tuple else (index,)
    for x in items:
        tp = type(x)
        if tp is int or x is None or x is Ellipsis:
            continue
        if tp is slice:
            for part in (x.start, x.stop, x.step):
                if not (part is None or type(part) is int):
                    return False
            continue
        return False
    return True


def _getitem(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t[index]``: a view at once for basic indexing, the general path otherwise."""
    if len(args) == 2 and not kwargs and _basic_index(args[1]):
        return _view(func, args, kwargs)
    return _general(func, args, kwargs)


# ---- what the handlers do --------------------------------------------------------------


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
    if isinstance(out, torch.Size) or not isinstance(out, _NODES):
        return out  # metadata (shape, dtype...) keeps its type: pytree would make a tuple

    def w(x: torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, FakeDeviceTensor) else wrap(x, vendor, index)

    return _map_tensors(w, out)


def _unwrap(tree: Any, *, snapshot_host: bool, keep: tuple[object, ...] = ()) -> Any:
    if not snapshot_host:
        return _map_tensors(plain, tree)

    def u(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, FakeDeviceTensor):
            return plain(x)
        for k in keep:
            if x is k:
                return x
        with _NoTF():
            return x.clone()

    return _map_tensors(u, tree)


def _count_uploads(vendor: Owner, tree: Any, keep: tuple[object, ...]) -> None:
    """Count host tensors handed to a device kernel as implicit synchronous uploads."""
    for x in _leaves(tree, []):
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
    keep = tuple(_leaves(target, []))
    pa, pk = _unwrap((args, kwargs), snapshot_host=True, keep=keep)
    _count_uploads(vendor, (args, kwargs), keep)
    vendor.tally.add("launches")
    vendor.current_stream(index).enqueue(lambda: func(*pa, **pk))
    return target


def _tensors_of(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [r for r in _leaves(out, []) if isinstance(r, torch.Tensor)]


def _compute(func: Callable[..., Any], args: Any, kwargs: Any, vendor: Owner, index: int) -> Any:
    minputs: list[torch.Tensor] = []

    def to_meta(x: torch.Tensor) -> torch.Tensor:
        with _NoTF():
            m = _empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        minputs.append(m)
        return m

    margs, mkwargs = _map_tensors(to_meta, args), _map_tensors(to_meta, kwargs)
    try:
        with _NoTF():
            mout = func(*margs, **mkwargs)
    except Exception:
        vendor.current_stream(index).synchronize()
        pa, pk = _unwrap((args, kwargs), snapshot_host=False)
        with _NoTF():
            out = func(*pa, **pk)
        for r in _tensors_of(out):
            vendor.memory.add_device(r, index)
        vendor.tally.add("launches")
        return _wrap_all(out, vendor, index)
    if isinstance(mout, torch.Tensor):
        mflat, spec = [mout], None
    else:
        mflat, spec = pytree.tree_flatten(mout)
    mtensors = [t for t in mflat if isinstance(t, torch.Tensor)]
    if not mtensors:  # metadata answer (size, data_ptr, ...): ask the real tensors
        pa, pk = _unwrap((args, kwargs), snapshot_host=False)
        with _NoTF():
            return func(*pa, **pk)
    for t in mtensors:
        if t.device.type != "meta":
            return _host_read(func, args, kwargs, vendor, index)
    for o in mtensors:
        for i in minputs:
            if _is_alias_of(o, i):  # a view
                pa, pk = _unwrap((args, kwargs), snapshot_host=False)
                with _NoTF():
                    return _wrap_all(func(*pa, **pk), vendor, index)
    outs: list[Any] = []
    fresh: list[torch.Tensor] = []
    for m in mflat:
        if isinstance(m, torch.Tensor):
            t = _empty_strided(m.size(), m.stride(), dtype=m.dtype)
            vendor.memory.add_device(t, index)
            fresh.append(t)
            outs.append(wrap(t, vendor, index))
        else:
            outs.append(m)
    pa, pk = _unwrap((args, kwargs), snapshot_host=True)
    _count_uploads(vendor, (args, kwargs), ())
    if getattr(func, "__name__", None) not in _NO_KERNEL:
        vendor.tally.add("launches")

    def run() -> None:
        res = _tensors_of(func(*pa, **pk))
        for dst, r in zip(fresh, res, strict=True):
            dst.copy_(r)

    vendor.current_stream(index).enqueue(run)
    return outs[0] if spec is None else pytree.tree_unflatten(outs, spec)
