"""What vLLM's CPU build needs in a process that also loads LMCache's CPU kernels.

:func:`patch_llvmlite_lib` is needed only where the engine core runs in the process that
imported LMCache first (the offline ``LLM`` API with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
``vllm serve`` starts its engine core as a fresh process and needs nothing.
"""

from __future__ import annotations

__all__ = ("patch_llvmlite_lib",)


def patch_llvmlite_lib() -> bool:
    """Give ``llvmlite.binding.ffi.lib`` a real ``__dict__`` answer; True when it was needed.

    vLLM 0.32's CPU platform scans module globals with ``vars(value).get("kernel")``; the
    llvmlite library object (loaded by numba, which LMCache's CPU kernels import) answers
    ``__dict__`` through its ``__getattr__`` with a function wrapper, and the scan fails with
    ``'_lib_fn_wrapper' object has no attribute 'get'``. Must run before the engine starts, in
    every process that starts an engine core.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return False
    lib = getattr(ffi, "lib", None)
    if lib is None:
        return False
    try:
        if isinstance(vars(lib), dict):
            return False
    except TypeError:
        pass
    # A slotted subclass with the same layout whose ``__dict__`` is a real (empty) mapping.
    base = type(lib)
    lib.__class__ = type(base.__name__, (base,), {"__slots__": (), "__dict__": property(_empty)})
    return True


def _empty(_self: object) -> dict[str, object]:
    return {}
