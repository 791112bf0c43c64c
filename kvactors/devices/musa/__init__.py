"""The Moore Threads MUSA backend (``torch_musa``) and its transfer contract.

``backend``: :class:`MusaBackend`; ``contract``: which MUSA transfers may run (pure).
"""

from kvactors.devices.musa.backend import HostRegistration as HostRegistration
from kvactors.devices.musa.backend import MusaBackend as MusaBackend
from kvactors.devices.musa.backend import MusaIPCOwner as MusaIPCOwner

__all__ = ("HostRegistration", "MusaBackend", "MusaIPCOwner")
