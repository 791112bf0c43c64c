"""LMCache ``DeviceSpec`` plugins backed by the kvactors runtime (LMCache 0.5.6 and 0.5.7).

LMCache imports this module while ``lmcache.v1.platform`` is still initialising, so only
``lmcache.v1.platform.base.*`` and ``transfer_mode`` are imported at module level; the rest is
lazy, and ``is_available()`` never raises. Specs: ``kvactors_mlu``, ``kvactors_musa`` and
``kvactors_cpu`` (test-only: available only with ``KVACTORS_LMCACHE_CPU=1``). An accelerator
spec is available only when selected by name (``LMCACHE_DEVICE_BACKEND``) or when it is the
only spec LMCache registered for its device type (read from LMCache's registry; unreadable
means no), and kvactors' probe finds the device. The MUSA handle path is opt-in
(``LMCACHE_MUSA_HANDLE_TRANSFER=1``, ``docs/lmcache-adapter.md``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from lmcache.v1.multiprocess.transfer_mode import MPTransferMode
from lmcache.v1.platform.base.device_spec import DeviceSpec

from kvactors.core.plugins import PLUGIN_CPU, PLUGIN_MLU, PLUGIN_MUSA

if TYPE_CHECKING:
    from lmcache.v1.platform.base.cache_context import BaseCacheContext
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.event_ipc import EventIPCBackend
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

__all__ = (
    "BACKEND_ENV",
    "CPU_ENV",
    "MUSA_HANDLE_ENV",
    "KvactorsCpuSpec",
    "KvactorsMluSpec",
    "KvactorsMusaSpec",
    "KvactorsSpecBase",
    "probe_backend",
    "registered_backends",
)

_log = logging.getLogger(__name__)

BACKEND_ENV = "LMCACHE_DEVICE_BACKEND"
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


_registry_guard = threading.local()


def registered_backends(device_type: str) -> tuple[str, ...] | None:
    """The ``backend_name`` of every spec LMCache registered for ``device_type``, in order.

    Read from LMCache's own (cached) backend registry, never by running device detection.
    ``None`` when the registry cannot be read (an LMCache without it, or a re-entrant call
    while the registry is being built); callers treat that as "not the only backend".
    """
    if getattr(_registry_guard, "active", False):
        return None
    _registry_guard.active = True
    try:
        from lmcache.v1.platform._device_detect import _build_device_registry

        specs = _build_device_registry().get(device_type, ())
        return tuple(str(s.backend_name) for s in specs)
    except Exception as exc:  # an LMCache without this registry: fail closed
        _log.debug("cannot read LMCache's backend registry: %s", exc)
        return None
    finally:
        _registry_guard.active = False


def _selected_name() -> str:
    return os.environ.get(BACKEND_ENV, "").strip().lower()


class KvactorsSpecBase(DeviceSpec):
    """Common part of the kvactors specs: engine-driven default, kvactors ops, stream handles."""

    #: kvactors backend kind (``kvactors.devices.get_backend`` key) this spec routes into.
    kvactors_backend: str = ""
    _told_to_step_aside: bool = False

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from kvactors_lmcache import ops

        return ops.ops_class_for(self.kvactors_backend)

    def default_mp_transfer_mode(self) -> MPTransferMode:
        """Always engine-driven: the handle path is opt-in (see ``docs/lmcache-adapter.md``)."""
        return MPTransferMode.ENGINE_DRIVEN

    def _probe(self) -> bool:
        available, reason = probe_backend(self.kvactors_backend)
        if not available and _selected_name() == self.backend_name:
            # LMCache only says "registered but not available"; say why.
            _log.warning("kvactors LMCache plugin %r is unavailable: %s", self.backend_name, reason)
        return available

    def _unambiguous(self) -> bool:
        """Selected by name, or the only backend LMCache registered for this device type."""
        if _selected_name() == self.backend_name:
            return True
        others = registered_backends(self.device_type)
        if others == (self.backend_name,):
            return True
        if not self._told_to_step_aside:
            self._told_to_step_aside = True
            _log.info(
                "kvactors LMCache plugin %r steps aside for device type %r (LMCache also has "
                "%s); select it with %s=%s",
                self.backend_name,
                self.device_type,
                ", ".join(n for n in (others or ()) if n != self.backend_name) or "an unknown set",
                BACKEND_ENV,
                self.backend_name,
            )
        return False

    def get_stream_handle(self, stream: object) -> int:
        """The native queue/stream pointer of ``stream`` as an ``int``."""
        for attr in ("mlu_stream", "musa_stream", "stream_handle", "ptr"):
            handle = getattr(stream, attr, None)
            if isinstance(handle, int) and not isinstance(handle, bool):
                return handle
        from kvactors.errors import DeviceOpError

        raise DeviceOpError(
            f"stream {stream!r} exposes no integer native handle",
            device=str(self.backend_name),
            op="get_stream_handle",
        )


class KvactorsMluSpec(KvactorsSpecBase):
    """Cambricon MLU through kvactors; ``LMCACHE_DEVICE_BACKEND=kvactors_mlu`` selects it.

    Auto-detected only where LMCache has no other MLU backend (0.5.6); LMCache 0.5.7's
    built-in ``mlu`` keeps auto-detection there.
    """

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
        """Unambiguous (see the module docstring) and an MLU visible; never raises."""
        try:
            return self._unambiguous() and self._probe()
        except Exception:
            return False


class KvactorsMusaSpec(KvactorsSpecBase):
    """Moore Threads MUSA through kvactors; ``LMCACHE_DEVICE_BACKEND=kvactors_musa`` selects it.

    LMCache's built-in ``musa`` keeps auto-detection unless kvactors is selected by name.
    """

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
        """Unambiguous (see the module docstring) and torch_musa present; never raises."""
        try:
            return self._unambiguous() and self._probe()
        except Exception:
            return False

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
            from kvactors.errors import UnsupportedOperationError

            raise UnsupportedOperationError(
                "the LMCache-driven (handle) path is disabled; set "
                f"{MUSA_HANDLE_ENV}=1 with TorchMUSA memory and event IPC, or use the "
                "engine_driven MP transfer mode",
                backend=PLUGIN_MUSA,
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
