"""The LMCache plugin names kvactors ships: the one place they are spelled.

Each entry point of :data:`ENTRY_POINT_GROUP` is named after its spec's ``backend_name``
(``LMCACHE_DEVICE_BACKEND=<name>``); the adapter's specs and ``kvactors doctor`` read these
constants and ``tests/core/test_plugins.py`` checks them against ``pyproject.toml``. Data only.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

__all__ = ("ENTRY_POINT_GROUP", "PLUGINS", "PLUGIN_CPU", "PLUGIN_MLU", "PLUGIN_MUSA")

ENTRY_POINT_GROUP: Final = "lmcache.device_plugins"
"""The entry-point group LMCache scans for device plugins."""

PLUGIN_MLU: Final = "kvactors_mlu"
"""Cambricon MLU; next to LMCache 0.5.7's built-in ``mlu`` it is used only when selected by name."""
PLUGIN_MUSA: Final = "kvactors_musa"
"""Moore Threads MUSA; selected by name only (LMCache's built-in ``musa`` exists)."""
PLUGIN_CPU: Final = "kvactors_cpu"
"""CPU; available only with ``KVACTORS_LMCACHE_CPU=1`` (tests, demos)."""

PLUGINS: Final = MappingProxyType({PLUGIN_MLU: "mlu", PLUGIN_MUSA: "musa", PLUGIN_CPU: "cpu"})
"""``backend_name -> device_type`` of every plugin kvactors ships."""
