"""Report what LMCache selected at import (one JSON line)."""

from __future__ import annotations

import json

import lmcache
from lmcache.v1.platform import resolve_device_ops
from lmcache.v1.platform._device_detect import current_device_spec


def qual(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


ops = resolve_device_ops("cpu")
print(
    json.dumps(
        {
            "ops": qual(ops),
            "device_ops": qual(lmcache.device_ops),
            "torch_dev": getattr(lmcache.torch_dev, "__name__", repr(lmcache.torch_dev)),
            "device_type": lmcache.torch_device_type,
            "spec": current_device_spec().backend_name,
        }
    )
)
