"""Ask LMCache's own device detection what it selects here; print it as one JSON object.

Run in a fresh interpreter (``kvactors doctor`` does; LMCache caches its detection per
process)::

    python .../kvactors_lmcache/detect.py

It imports lmcache and reads LMCache's own answers (the selected backend, every registered
spec's ``is_available()``, the MP transfer mode), reporting an import error and still reading
the registry. Missing private names become ``unknown`` fields. It imports nothing of kvactors
(nor torch) before lmcache: what is imported first changes LMCache's registry (with torch
first it lists ``hpu``). ``kvactors doctor --fake KIND`` installs kvactors' fake vendor
module in the interpreter before it runs this file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
from typing import Any

__all__ = ("detect", "main")

_DETECT_MODULE = "lmcache.v1.platform._device_detect"


def _qual(obj: object) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _registry(dd: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, spec in dd._build_backend_registry().items():
        module = type(spec).__module__
        try:
            available: bool | None = bool(spec.is_available())
            why = ""
        except Exception as exc:  # LMCache would propagate this; report it
            available, why = None, _error_text(exc)
        out.append(
            {
                "backend": str(name),
                "device_type": str(spec.device_type),
                "origin": "builtin" if module.startswith("lmcache.") else "plugin",
                "kvactors": module.startswith("kvactors_lmcache."),
                "spec": _qual(spec),
                "available": available,
                "error": why,
            }
        )
    return out


def _transfer_mode(dd: Any, device_type: str) -> dict[str, str]:
    try:
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import _resolve_mode
        from lmcache.v1.multiprocess.transfer_mode import MPTransferMode
    except Exception as exc:
        return {"mode": "unknown", "reason": _error_text(exc), "error": ""}
    try:
        mode = _resolve_mode(None)
    except ValueError as exc:
        return {"mode": "invalid", "reason": "LMCACHE_MP_TRANSFER_MODE", "error": str(exc)}
    spec = dd.get_device_spec(device_type)
    if mode is MPTransferMode.AUTO:
        if spec is None:
            return {"mode": "engine_driven", "reason": "auto: no spec for the device", "error": ""}
        mode = spec.default_mp_transfer_mode()
        reason = f"auto: {type(spec).__name__}.default_mp_transfer_mode()"
    else:
        reason = "LMCACHE_MP_TRANSFER_MODE"
    error = ""
    if mode is MPTransferMode.LMCACHE_DRIVEN:
        try:
            from lmcache.v1.platform.kv_wrap import resolve_kv_wrapper_factory

            resolve_kv_wrapper_factory(device_type)
        except Exception as exc:
            error = (
                f"MP transfer mode 'lmcache_driven' is not supported for device type "
                f"{device_type!r}: {exc}"
            )
    return {"mode": str(mode.value), "reason": reason, "error": error}


def detect() -> dict[str, Any]:
    """What LMCache selects in this process's environment (imports lmcache; call once)."""
    out: dict[str, Any] = {
        "lmcache": None,
        "outcome": "error",
        "backend": None,
        "device_type": "",
        "kvactors": False,
        "error": "",
        "registry": [],
        "transfer_mode": {"mode": "unknown", "reason": "", "error": ""},
        "env": {k: os.environ[k] for k in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE",
                                           "LMCACHE_MP_TRANSFER_MODE") if k in os.environ},
    }  # fmt: skip
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["lmcache"] = importlib.metadata.version("lmcache")
    try:
        import lmcache  # noqa: F401  (runs LMCache's device detection)
        from lmcache.v1.platform import _device_detect as dd

        _, device_type, backend = dd._detect_device()
    except Exception as exc:
        out["error"] = _error_text(exc)
        dd = sys.modules.get(_DETECT_MODULE)
        if dd is not None:
            with contextlib.suppress(Exception):
                out["registry"] = _registry(dd)
        return out
    out["registry"] = _registry(dd)
    out["device_type"] = str(device_type)
    if backend is None:
        out["outcome"] = "stub"
    else:
        out["outcome"] = "selected"
        out["backend"] = str(backend)
        out["kvactors"] = any(r["backend"] == backend and r["kvactors"] for r in out["registry"])
    out["transfer_mode"] = _transfer_mode(dd, str(device_type))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print :func:`detect`'s answer as one JSON line; exit 0 even when detection raised."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    result = detect()
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
