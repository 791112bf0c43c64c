"""Module objects shaped like torch_mlu / torch_musa, and their installation.

``torch.mlu`` is the submodule ``torch_mlu.mlu``; ``torch.musa`` is the ``torch_musa``
package. Installation puts them in ``sys.modules`` and on ``torch`` and patches the torch
entry points real vendors extend (tensor factories, storage from data pointer, pinning, MLU
storage sharing); every patch is undone on exit, in reverse order, so fakes nest. With the
private device name taken, the fakes answer ``is_pinned`` for the memory they pinned (torch
2.4/2.5 offer no Python hook registration) and False otherwise.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import TYPE_CHECKING, Any

import torch

from kvactors.testing import _ipc
from kvactors.testing._device import (
    FakeDevice,
    FakeDeviceError,
    claim_device_name,
    parse_fake_device,
    private_backend_named,
)
from kvactors.testing._memory import FakeMusart
from kvactors.testing._tensor import FakeDeviceTensor, move_to, parse_to, plain, wrap
from kvactors.testing.vendor import new_module

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.testing.vendor import FakeVendor

__all__ = ("Installation",)

_MISSING = object()
_TORCH_IS_PINNED = torch.Tensor.is_pinned
# Factories outside aten's schemas (Python bindings) that take ``device=``.
_EXTRA_FACTORIES = ("asarray",)
# Factories the fakes leave alone: sparse and quantized layouts are not modelled.
_SKIPPED_FACTORIES = ("empty_quantized", "from_file")
_UPLOADS = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})
# Tensor methods that create a tensor on ``device=`` (on a host tensor too).
_TENSOR_FACTORIES = (
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_tensor",
)


@functools.lru_cache(maxsize=1)
def factories() -> tuple[tuple[str, ...], frozenset[str]]:
    """(torch functions that create a tensor on ``device=``, those that take ``generator=``).

    Derived once from aten's operator schemas (every public ``torch.<name>`` with a
    ``device`` argument), so a factory torch adds is covered without a list to keep.
    """
    names: set[str] = set(_EXTRA_FACTORIES)
    random: set[str] = set()
    for schema in torch._C._jit_get_all_schemas():
        qualified = schema.name
        if not qualified.startswith("aten::"):
            continue
        name = qualified[6:]
        if name.startswith(("_", "sparse_")) or name in _SKIPPED_FACTORIES:
            continue
        args = {a.name for a in schema.arguments}
        fn = getattr(torch, name, None)
        if "device" in args and callable(fn) and not isinstance(fn, type):
            names.add(name)
            if "generator" in args:
                random.add(name)
    return tuple(sorted(n for n in names if hasattr(torch, n))), frozenset(random)


def _ours(vendor: FakeVendor, device: object) -> int | None:
    if device is None or isinstance(device, int):
        return None
    if isinstance(device, (FakeDevice, str, torch.device)):
        idx = parse_fake_device(device, vendor.kind, vendor.current_device())
        return None if idx is None else vendor.device_index(idx)
    return None


def _construct_from_storage(vendor: FakeVendor, metadata: dict[str, Any], storage: Any) -> Any:
    index = vendor.memory.device_of(storage.data_ptr(), storage.nbytes())
    if index is None:
        raise FakeDeviceError(f"storage is not {vendor.kind} device memory")
    view = torch.empty(0, dtype=metadata["dtype"]).set_(
        storage,
        int(metadata.get("storage_offset", 0)),
        tuple(metadata["size"]),
        tuple(metadata["stride"]),
    )
    return wrap(view, vendor, index)


def _forget_module(name: str) -> None:
    sys.modules.pop(name, None)


class Installation:
    """Builds the module objects for one vendor and (un)installs them and the patches."""

    def __init__(self, vendor: FakeVendor) -> None:
        self.vendor = vendor
        self._undo: list[Callable[[], None]] = []
        self.modules = self._build()

    # ---- module objects -----------------------------------------------------------

    def _build(self) -> dict[str, types.ModuleType]:
        v = self.vendor
        knobs = v.knobs
        ctor = (
            knobs.vendor_constructor if knobs.vendor_constructor is not None else (v.kind == "musa")
        )
        api = new_module(
            f"torch_{v.kind}" if v.kind == "musa" else "torch_mlu.mlu",
            f"Fake torch.{v.kind} (kvactors.testing).",
        )
        for name, value in v.module_functions():
            setattr(api, name, value)
        if not knobs.event_ipc:
            v.Event.from_ipc_handle = None  # type: ignore[assignment,method-assign]
        cext = new_module(f"torch_{v.kind}._{v.kind.upper()}C", "Fake C extension.")
        setattr(cext, f"_{v.kind}_getDeviceCount", v.device_count)
        if ctor:
            setattr(
                cext,
                f"_construct_{v.kind.upper()}_Tensor_From_Storage_And_Metadata",
                functools.partial(_construct_from_storage, v),
            )
        if v.kind == "musa":
            pkg = api
            pkg.__path__ = []  # a package, so "torch_musa.ipc" imports
            pkg._MUSAC = cext  # type: ignore[attr-defined]
            pkg.__version__ = "0.0.0+kvactors.fake"  # type: ignore[attr-defined]
            mods = {"torch_musa": pkg, "torch_musa._MUSAC": cext}
            if knobs.musart:
                rt = FakeMusart(v.memory)
                pkg.musart = lambda: rt  # type: ignore[attr-defined]
            if knobs.ipc:
                ipc = new_module("torch_musa.ipc", "Fake torch.musa.ipc.")
                ipc.MUSAIPCTensorHandle = _ipc.MUSAIPCTensorHandle  # type: ignore[attr-defined]
                ipc.MUSAIPCTensor = _ipc.FakeMUSAIPCTensor  # type: ignore[attr-defined]
                ipc.export_tensor = functools.partial(_ipc.export_tensor, v)  # type: ignore[attr-defined]
                ipc.open_tensor = functools.partial(_ipc.open_tensor, v)  # type: ignore[attr-defined]
                pkg.ipc = ipc  # type: ignore[attr-defined]
                mods["torch_musa.ipc"] = ipc
            return mods
        pkg = new_module("torch_mlu", "Fake torch_mlu (kvactors.testing).")
        pkg.__path__ = []
        pkg.mlu = api  # type: ignore[attr-defined]
        pkg._MLUC = cext  # type: ignore[attr-defined]
        pkg.__version__ = "0.0.0+kvactors.fake"  # type: ignore[attr-defined]
        api.cnrt = lambda: types.SimpleNamespace(  # type: ignore[attr-defined]
            mluError=types.SimpleNamespace(success=0), mluGetErrorStr=str
        )
        return {"torch_mlu": pkg, "torch_mlu.mlu": api, "torch_mlu._MLUC": cext}

    @property
    def torch_attr(self) -> types.ModuleType:
        """What becomes ``torch.<kind>``."""
        key = "torch_musa" if self.vendor.kind == "musa" else "torch_mlu.mlu"
        return self.modules[key]

    # ---- install / uninstall ------------------------------------------------------

    def _set(self, owner: Any, name: str, value: Any) -> None:
        old = (
            owner.__dict__.get(name, _MISSING)
            if isinstance(owner, type)
            else getattr(owner, name, _MISSING)
        )

        def undo() -> None:
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

        setattr(owner, name, value)
        self._undo.append(undo)

    def install(self) -> None:
        """Put the fake in ``sys.modules``/``torch`` and apply the torch patches."""
        v = self.vendor
        for name in self.modules:
            if name in sys.modules:
                raise RuntimeError(f"{name} is already imported; cannot install a fake over it")
        if hasattr(torch, v.kind):
            raise RuntimeError(f"torch.{v.kind} already exists; cannot install a fake over it")
        v.torch_devices = claim_device_name(v.kind)
        for name, mod in self.modules.items():
            sys.modules[name] = mod
            self._undo.append(functools.partial(_forget_module, name))
        self._set(torch, v.kind, self.torch_attr)
        self._set(torch.Tensor, "to", self._to(torch.Tensor.to))
        self._set(torch.Tensor, v.kind, self._to_vendor())
        if f"is_{v.kind}" not in vars(torch.Tensor):
            self._set(
                torch.Tensor,
                f"is_{v.kind}",
                property(
                    lambda t: isinstance(t, FakeDeviceTensor) and t._fake_vendor.kind == v.kind
                ),
            )
        names, random = factories()
        for fname in names:
            self._set(torch, fname, self._factory(fname, getattr(torch, fname), fname in random))
        for fname in _TENSOR_FACTORIES:
            self._set(torch.Tensor, fname, self._factory(fname, getattr(torch.Tensor, fname)))
        # As torch._register_device_module does for a real vendor: torch imports
        # "torch.<name>" for its private device in places (lazy init, RNG).
        if v.torch_devices and f"torch.{v.kind}" not in sys.modules:
            sys.modules[f"torch.{v.kind}"] = self.torch_attr
            self._undo.append(functools.partial(_forget_module, f"torch.{v.kind}"))
        self._set(
            torch._C,
            "_construct_storage_from_data_pointer",
            self._storage_from_ptr(torch._C._construct_storage_from_data_pointer),
        )
        self._set(torch.Tensor, "pin_memory", self._pin_memory(torch.Tensor.pin_memory))
        self._set(torch.Tensor, "is_pinned", self._is_pinned(torch.Tensor.is_pinned))
        if v.kind == "mlu" and v.knobs.ipc:
            self._set(
                torch.UntypedStorage, "_share_mlu_", lambda storage: _ipc.share_storage(v, storage)
            )
            self._set(
                torch.UntypedStorage,
                "_new_shared_mlu",
                staticmethod(lambda *info: _ipc.new_shared(v, tuple(info))),
            )

    def uninstall(self) -> None:
        """Undo every patch, in reverse order (idempotent)."""
        while self._undo:
            self._undo.pop()()

    # ---- patched torch entry points ------------------------------------------------

    def _factory(
        self, fname: str, orig: Callable[..., Any], random: bool = False
    ) -> Callable[..., Any]:
        """The one path for every factory: ``device=`` a fake device makes the tensor in
        host memory (random ones from the device's generator), records it as device memory
        and returns it as a device tensor; any other call goes to torch unchanged."""
        v = self.vendor

        @functools.wraps(orig)
        def factory(*args: Any, **kwargs: Any) -> Any:
            idx = _ours(v, kwargs.get("device"))
            if idx is None:
                if kwargs.get("pin_memory") and kwargs.get("device") in (None, "cpu"):
                    kwargs = {**kwargs, "pin_memory": False}
                    out = orig(*args, **kwargs)
                    v.memory.add_pinned(out)
                    return out
                return orig(*args, **kwargs)
            first = args[0] if args else kwargs.get("data")
            if (
                fname == "as_tensor"
                and isinstance(first, FakeDeviceTensor)
                and (
                    first._fake_vendor is v
                    and first._fake_index == idx
                    and kwargs.get("dtype") in (None, first.dtype)
                )
            ):
                return first  # already there: as_tensor returns its input
            kwargs = {**kwargs, "device": "cpu"}
            if random and kwargs.get("generator") is None:
                kwargs["generator"] = v.generator(idx)
            args = tuple(plain(a) if isinstance(a, FakeDeviceTensor) else a for a in args)
            out = orig(*args, **kwargs)
            v.memory.add_device(out, idx)
            if fname in _UPLOADS:  # host data, uploaded from pageable memory
                v.tally.add("h2d")
                v.tally.add("syncs")
            elif "empty" not in fname:  # a fill kernel
                v.tally.add("launches")
            return wrap(out, v, idx)

        return factory

    def _to(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        v = self.vendor

        @functools.wraps(orig)
        def to(self_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(self_, FakeDeviceTensor):
                device, dtype, non_blocking, copy = parse_to((self_, *args), kwargs)
                idx = _ours(v, device)
                if idx is not None:
                    return move_to(self_, v, idx, dtype, non_blocking, copy)
            return orig(self_, *args, **kwargs)

        return to

    def _to_vendor(self) -> Callable[..., Any]:
        v = self.vendor

        def to_vendor(
            self_: torch.Tensor,
            device: object = None,
            non_blocking: bool = False,
            **kwargs: Any,
        ) -> torch.Tensor:
            """``Tensor.mlu()`` / ``Tensor.musa()``: a copy on the fake device (or self)."""
            return move_to(self_, v, v.device_index(device), None, non_blocking, False)

        to_vendor.__name__ = v.kind
        return to_vendor

    def _storage_from_ptr(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        v = self.vendor

        def construct(ptr: int, device: Any, nbytes: int) -> Any:
            idx = _ours(v, device)
            if idx is None:
                return orig(ptr, device, nbytes)
            if nbytes > 0 and v.memory.device_of(ptr, nbytes) != idx:
                raise FakeDeviceError(
                    f"[{ptr:#x}, +{nbytes}) is not memory of {v.kind}:{idx} (a host pointer?)"
                )
            return orig(ptr, torch.device("cpu"), nbytes)

        return construct

    def _pin_memory(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        v = self.vendor

        def pin_memory(self_: torch.Tensor, device: object = None) -> torch.Tensor:
            if isinstance(self_, FakeDeviceTensor):
                if self_.device.type != v.kind:
                    out: torch.Tensor = orig(self_) if device is None else orig(self_, device)
                    return out
                raise RuntimeError("cannot pin a device tensor")
            out = self_.clone(memory_format=torch.contiguous_format)
            v.memory.add_pinned(out)
            return out

        return pin_memory

    def _is_pinned(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        v = self.vendor

        def is_pinned(self_: torch.Tensor, device: object = None) -> bool:
            if isinstance(self_, FakeDeviceTensor):
                return False
            if v.memory.is_pinned(self_):
                return True
            if orig is _TORCH_IS_PINNED and private_backend_named():
                # The end of the chain (each installed fake asked its own memory): torch would
                # ask the named private backend's hooks, see the module notes.
                return False
            return bool(orig(self_))

        return is_pinned
