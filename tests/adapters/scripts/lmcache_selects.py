"""The oracle for selection tests: what LMCache itself selects in this environment.

Usage: lmcache_selects.py [--fake mlu|musa] [--hide-kvactors]

Written independently of ``kvactors_lmcache/detect.py`` (the doctor's probe) and of
kvactors' rules: it imports lmcache exactly as an application would and prints LMCache's own
answers as one JSON line. ``--fake`` installs kvactors' fake vendor module first;
``--hide-kvactors`` removes kvactors' entry points before LMCache discovers plugins, which
answers "what would LMCache select if kvactors were not installed".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def _hide_kvactors() -> None:
    real = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        eps = real(**params)
        if params.get("group") == "lmcache.device_plugins":
            return [ep for ep in eps if not ep.value.startswith("kvactors_lmcache.")]  # type: ignore[attr-defined]
        return eps

    importlib.metadata.entry_points = entry_points  # type: ignore[assignment]


def ask() -> dict[str, Any]:
    out: dict[str, Any] = {"backend": None, "device_type": None, "error": None}
    try:
        import lmcache
        import lmcache.v1.platform
        from lmcache.v1.platform._device_detect import _build_device_registry, current_device_spec
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    spec = current_device_spec()
    stub = type(lmcache.torch_dev).__name__ == "StubCPUDevice"
    out["backend"] = None if stub else spec.backend_name
    out["device_type"] = lmcache.torch_device_type
    out["registry"] = {t: [s.backend_name for s in specs]
                       for t, specs in _build_device_registry().items()}  # fmt: skip
    try:
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import _resolve_mode
        from lmcache.v1.platform import get_device_spec, resolve_kv_wrapper_factory

        mode = _resolve_mode(None).value
        if mode == "auto":
            dspec = get_device_spec(lmcache.torch_device_type)
            mode = "engine_driven" if dspec is None else dspec.default_mp_transfer_mode().value
        if mode == "lmcache_driven":
            resolve_kv_wrapper_factory(lmcache.torch_device_type)
        out["mode"] = mode
    except ValueError as exc:
        out["mode_error"] = str(exc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fake", choices=("mlu", "musa"))
    ap.add_argument("--hide-kvactors", action="store_true")
    args = ap.parse_args()
    if args.hide_kvactors:
        _hide_kvactors()
    if args.fake:
        from kvactors.testing import fake_vendor

        with fake_vendor(args.fake):
            result = ask()
    else:
        result = ask()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
