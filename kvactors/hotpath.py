"""The compiled hot path: build it once per torch, load it if it was built.

Theory of operation. ``kvactors/_compiled/hotpath.cpp`` compiles the steps of a transfer
that touch the most Python objects (the plan cache's operand fingerprint and id checks, the
stacked copy in both directions and the host rows scatter; see that file) into a torch C++
extension. Each has a pure-Python twin that does the same work, and kvactors runs everywhere
without the extension; with it, a small model's call costs the host less (``kvactors bench``
reports which one ran).

:func:`build` compiles the source with torch's own extension builder (a C++ compiler and
``ninja`` are needed) into a folder named by a digest of the source, the torch version and
install folder, and the Python ABI, under ``$KVACTORS_CACHE_DIR`` (default
``~/.cache/kvactors``). :func:`load` only imports a build made for exactly this source and
this torch (it never compiles: an import must not start a compiler); anything else, or
``KVACTORS_HOTPATH=0``, leaves the Python twins in use. ``KVACTORS_HOTPATH=1`` makes a
missing or broken build an error instead.

Build it with ``kvactors hotpath --build`` (``scripts/setup.sh`` does).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from kvactors.errors import InvalidSettingError, MissingDependencyError

__all__ = ("Hotpath", "build", "build_dir", "load", "status")

_SOURCE = Path(__file__).with_name("_compiled") / "hotpath.cpp"
_ENV = "KVACTORS_HOTPATH"
_ABI = 3


class Hotpath(Protocol):
    """What the extension exports (see ``_compiled/hotpath.cpp``)."""

    ABI: int

    def operand_key(
        self, paged: object, objects: object
    ) -> tuple[bytes, bytes, int, bool] | None: ...

    def touched_blocks(
        self, ids: tuple[int, ...], nb: int, start: int, stop: int, unique: bool
    ) -> frozenset[int] | None: ...

    def StackedGather(
        self,
        size: Any,
        stride: Any,
        offset: int,
        dim: int,
        outs: Any,
    ) -> Any: ...

    def StackedRuns(
        self,
        size: Any,
        stride: Any,
        offset: int,
        dim: int,
        outs: Any,
        to_chunk: bool,
    ) -> Any: ...

    def RowsScatter(self, nrows: int, piece: int, row_stride: int, offset: int) -> Any: ...


_lock = threading.Lock()
# (module or None,) once an import was tried, None before. Replaced whole, never mutated: a
# reader without the lock sees the old tuple or the new one.
_loaded: tuple[Hotpath | None] | None = None
_reason: list[str] = [""]


def _tag() -> str:
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(str(Path(torch.__file__).resolve().parent).encode())  # this torch install
    digest.update(str(sysconfig.get_config_var("SOABI")).encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """The folder of this source's build for this torch install and this Python."""
    root = os.environ.get("KVACTORS_CACHE_DIR") or str(Path.home() / ".cache" / "kvactors")
    return Path(root) / "hotpath" / _tag()


def _name() -> str:
    return f"kvactors_hotpath_{_tag()}"


def build(*, verbose: bool = False) -> Path:
    """Compile the extension for the installed torch (if not built already); return the
    built module's path. Raises :class:`~kvactors.errors.MissingDependencyError` without
    ``ninja`` or a C++ compiler."""
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as exc:
        raise MissingDependencyError(
            "building the hot path needs ninja (pip install ninja)", package="ninja"
        ) from exc
    cpp_extension.load(
        _name(),
        [str(_SOURCE)],
        extra_cflags=["-O2"],
        build_directory=str(out),
        verbose=verbose,
    )
    global _loaded  # one tuple, replaced whole under the lock
    with _lock:
        _loaded = None  # the next load() imports the new build
    return _module_path(out)


def _module_path(out: Path) -> Path:
    suffix = importlib.machinery.EXTENSION_SUFFIXES
    for s in (".so", *suffix):
        p = out / f"{_name()}{s}"
        if p.exists():
            return p
    return out / f"{_name()}.so"


def _import() -> Hotpath | None:
    path = _module_path(build_dir())
    if not path.exists():
        _reason[0] = f"not built for this torch ({path} missing; run kvactors hotpath --build)"
        return None
    try:
        spec = importlib.util.spec_from_file_location(_name(), path)
        if spec is None or spec.loader is None:
            _reason[0] = f"{path} is not an extension module"
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        _reason[0] = f"built but not loadable: {exc}"
        return None
    if getattr(module, "ABI", None) != _ABI:
        _reason[0] = f"{path} has another ABI"
        return None
    _reason[0] = f"loaded from {path}"
    return module  # type: ignore[return-value]


def load() -> Hotpath | None:
    """The extension if it was built for this source and torch, else ``None`` (the Python
    twins run). ``KVACTORS_HOTPATH=0`` turns it off; ``=1`` raises
    :class:`~kvactors.errors.MissingDependencyError` when it cannot be loaded."""
    setting = os.environ.get(_ENV, "")
    global _loaded  # one tuple, replaced whole under the lock
    tried = _loaded
    if tried is not None and tried[0] is not None and (setting == "" or setting == "1"):
        return tried[0]  # the common call: no lock
    if setting not in ("", "0", "1"):
        raise InvalidSettingError(f"{_ENV} must be 0 or 1, got {setting!r}", setting=_ENV)
    if setting == "0":
        _reason[0] = f"off ({_ENV}=0)"
        return None
    with _lock:
        if _loaded is None:
            _loaded = (_import(),)
        module = _loaded[0]
    if module is None and setting == "1":
        raise MissingDependencyError(f"{_ENV}=1 but the hot path {_reason[0]}", package="kvactors")
    return module


def status() -> str:
    """One line: whether the compiled hot path is in use, and why (or why not)."""
    module = load() if os.environ.get(_ENV) != "1" else _safe_load()
    return ("compiled: " if module is not None else "python: ") + _reason[0]


def _safe_load() -> Hotpath | None:
    try:
        return load()
    except MissingDependencyError:
        return None
