"""The CPU backend and its shared-memory IPC.

``backend``: :class:`CpuBackend`; ``shm``: named POSIX segments behind wire-safe handles.
"""

from kvactors.devices.cpu.backend import CpuBackend as CpuBackend
from kvactors.devices.cpu.backend import CpuStream as CpuStream

__all__ = ("CpuBackend", "CpuStream")
