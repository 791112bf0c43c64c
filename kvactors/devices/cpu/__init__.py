"""The CPU backend and its shared-memory IPC.

``backend``: :class:`CpuBackend`; ``shm``: named POSIX segments behind wire-safe handles.
"""

from kvactors.devices.cpu.backend import CpuBackend as CpuBackend
from kvactors.devices.cpu.backend import CpuStream as CpuStream
from kvactors.devices.cpu.backend import completes_on_launch as completes_on_launch

__all__ = ("CpuBackend", "CpuStream", "completes_on_launch")
