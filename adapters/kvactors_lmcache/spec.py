"""LMCache 0.5.6 ``DeviceSpec`` plugins backed by the kvactors runtime.

Theory of operation. LMCache imports this module through the ``lmcache.device_plugins``
entry points *while ``lmcache.v1.platform`` is still initialising*, so at module level it
imports only ``lmcache.v1.platform.base.*`` and the leaf ``transfer_mode`` module. Everything
device-specific (the ops class, kvactors' backends, vendor modules, LMCache's MUSA handle
stack) is imported lazily inside properties and methods. ``is_available()`` never raises:
every probe error reads as "unavailable".

Three specs, one per entry point (the entry-point name equals ``backend_name``):

* ``mlu`` (device_type ``mlu``): LMCache 0.5.6 has no MLU backend, so auto-detection picks it
  whenever torch_mlu is importable and an MLU is visible.
* ``kvactors_musa`` (device_type ``musa``): collides with LMCache's built-in ``musa``; every
  process must set ``LMCACHE_DEVICE_BACKEND=kvactors_musa``.
* ``kvactors_cpu`` (device_type ``cpu``): test-only, available only with
  ``KVACTORS_LMCACHE_CPU=1``. ``cpu`` comes first in LMCache's registry order, so an available
  CPU spec would hijack ``torch_dev`` and beat accelerator plugins; it defaults to unavailable.

All three default to the engine-driven MP path. The MUSA handle (lmcache-driven) path is
opt-in through ``LMCACHE_MUSA_HANDLE_TRANSFER=1`` and limited by LMCache 0.5.6 (see
``docs/lmcache-adapter.md``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lmcache.v1.multiprocess.transfer_mode import MPTransferMode
from lmcache.v1.platform.base.device_spec import DeviceSpec

from kvactors.plugins import PLUGIN_CPU, PLUGIN_MLU, PLUGIN_MUSA

if TYPE_CHECKING:
    from lmcache.v1.platform.base.cache_context import BaseCacheContext
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.event_ipc import EventIPCBackend
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

__all__ = (
    "CPU_ENV",
    "MUSA_HANDLE_ENV",
    "KvactorsCpuSpec",
    "KvactorsMusaSpec",
    "KvactorsSpecBase",
    "MluSpec",
    "probe_backend",
)

_log = logging.getLogger(__name__)

CPU_ENV = "KVACTORS_LMCACHE_CPU"
MUSA_HANDLE_ENV = "LMCACHE_MUSA_HANDLE_TRANSFER"
_TRUE = ("1", "true", "yes", "on")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def probe_backend(kind: str) -> tuple[bool, str]:
    """Probe kvactors' backend ``kind``; never raises.

    Returns:
        ``(available, reason)``; ``reason`` says what is missing when unavailable.
    """
    try:
        from kvactors.devices import get_backend

        probe = get_backend(kind).probe()
        return bool(probe.available), str(probe.reason)
    except Exception as exc:  # probe contract: any failure means unavailable
        return False, f"{type(exc).__name__}: {exc}"


class KvactorsSpecBase(DeviceSpec):
    """Common part of the kvactors specs: engine-driven default, kvactors ops, stream handles."""

    #: kvactors backend kind (``kvactors.devices.get_backend`` key) this spec routes into.
    kvactors_backend: str = ""

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from kvactors_lmcache import ops

        return ops.ops_class_for(self.kvactors_backend)

    def default_mp_transfer_mode(self) -> MPTransferMode:
        """Always engine-driven: the handle path is opt-in (see ``docs/lmcache-adapter.md``)."""
        return MPTransferMode.ENGINE_DRIVEN

    def _probe(self) -> bool:
        available, reason = probe_backend(self.kvactors_backend)
        selected = os.environ.get("LMCACHE_DEVICE_BACKEND", "").strip().lower()
        if not available and selected == self.backend_name:
            # LMCache only says "registered but not available"; say why.
            _log.warning("kvactors LMCache plugin %r is unavailable: %s", self.backend_name, reason)
        return available

    def get_stream_handle(self, stream: object) -> int:
        """The native queue/stream pointer of ``stream`` as an ``int``."""
        for attr in ("mlu_stream", "musa_stream", "stream_handle", "ptr"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int) and not isinstance(handle, bool):
                return handle
        raise RuntimeError(
            f"{self.backend_name}: stream {stream!r} exposes no integer native handle"
        )


class MluSpec(KvactorsSpecBase):
    """Cambricon MLU through kvactors (LMCache 0.5.6 has no built-in MLU backend)."""

    kvactors_backend = "mlu"

    @property
    def device_type(self) -> str:
        return "mlu"

    @property
    def backend_name(self) -> str:
        return PLUGIN_MLU

    @property
    def torch_module_name(self) -> str:
        return "mlu"

    def is_available(self) -> bool:
        """torch_mlu importable and at least one MLU visible; never raises."""
        return self._probe()


class KvactorsMusaSpec(KvactorsSpecBase):
    """Moore Threads MUSA through kvactors; select with ``LMCACHE_DEVICE_BACKEND=kvactors_musa``."""

    kvactors_backend = "musa"
    _event_backend_cache: EventIPCBackend | None = None

    @property
    def device_type(self) -> str:
        return "musa"

    @property
    def backend_name(self) -> str:
        return PLUGIN_MUSA

    @property
    def torch_module_name(self) -> str:
        return "musa"

    def is_available(self) -> bool:
        """torch_musa present (kvactors' musa backend probe); never raises."""
        return self._probe()

    @property
    def pin_memory_backend(self) -> Any:
        from lmcache.v1.platform.devices.musa.pin_memory import MusaPinMemoryBackend

        return MusaPinMemoryBackend

    # The handle (lmcache-driven) path: opt-in, fail closed. See docs/lmcache-adapter.md.

    def is_lmcache_driven_available(self) -> bool:
        """Opt-in (``LMCACHE_MUSA_HANDLE_TRANSFER=1``) plus TorchMUSA memory and event IPC."""
        if not _env_on(MUSA_HANDLE_ENV):
            return False
        try:
            from lmcache.v1.platform.devices.musa.ipc_wrapper import (
                is_musa_handle_transfer_available,
            )

            return bool(is_musa_handle_transfer_available())
        except Exception:
            return False

    @property
    def ipc_wrapper_cls(self) -> type[DeviceIPCWrapper] | None:
        # LMCache 0.5.6's IPC wire only serialises wrapper classes defined inside
        # lmcache.v1.platform.devices (ipc_wire.WRAPPER_TYPES), so the only wrapper a plugin
        # can ship is LMCache's own MusaIPCWrapper.
        if not self.is_lmcache_driven_available():
            return None
        from lmcache.v1.platform.devices.musa.ipc_wrapper import MusaIPCWrapper

        wrapper: type[Any] = MusaIPCWrapper
        return wrapper

    @property
    def event_ipc_backend(self) -> EventIPCBackend | None:
        if not self.is_lmcache_driven_available():
            return None
        backend = self._event_backend_cache
        if backend is None:
            from lmcache.v1.platform.devices.musa.event_ipc import MusaEventIPCBackend

            backend = MusaEventIPCBackend()
            self._event_backend_cache = backend
        return backend

    def create_cache_context(self, *args: Any, **kwargs: Any) -> BaseCacheContext:
        """Server-side cache context for the handle path (arguments forwarded verbatim)."""
        if not self.is_lmcache_driven_available():
            raise NotImplementedError(
                "kvactors_musa: the LMCache-driven (handle) path is disabled; set "
                f"{MUSA_HANDLE_ENV}=1 with TorchMUSA memory and event IPC, or use the "
                "engine_driven MP transfer mode"
            )
        from kvactors_lmcache.handle import create_musa_cache_context

        return create_musa_cache_context(*args, **kwargs)


class KvactorsCpuSpec(KvactorsSpecBase):
    """CPU through kvactors, for tests and demos; available only with ``KVACTORS_LMCACHE_CPU=1``."""

    kvactors_backend = "cpu"

    @property
    def device_type(self) -> str:
        return "cpu"

    @property
    def backend_name(self) -> str:
        return PLUGIN_CPU

    @property
    def torch_module_name(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        """Only when ``KVACTORS_LMCACHE_CPU=1``; never raises."""
        try:
            return _env_on(CPU_ENV)
        except Exception:
            return False
