"""kvactors: an actor runtime for KV-cache transfers on MLU, MUSA and CPU.

Per device, a few actors with bounded mailboxes; idle actors' turns run on the calling thread,
queued copies on one lane thread per stream, and ``a*`` calls through an asyncio loop thread.

The public surface: :class:`Runtime` (one per device and process, thread-safe blocking calls
plus ``a*`` asyncio twins) and :func:`get_runtime` (the process-wide one), the transfer
request types, the exception hierarchy, and the backends registry. Public fakes live in
:mod:`kvactors.testing`; the LMCache plugin is the separate package ``kvactors_lmcache``.
"""

from __future__ import annotations

from kvactors.core.layouts import Direction as Direction
from kvactors.core.layouts import KVFormat as KVFormat
from kvactors.core.layouts import ShapeDesc as ShapeDesc
from kvactors.core.plans import TransferRequest as TransferRequest
from kvactors.devices import get_backend as get_backend
from kvactors.devices import probe_all as probe_all
from kvactors.errors import ActorBrokenError as ActorBrokenError
from kvactors.errors import ActorClosedError as ActorClosedError
from kvactors.errors import BackendUnavailableError as BackendUnavailableError
from kvactors.errors import DeadlineExceededError as DeadlineExceededError
from kvactors.errors import DeviceOpError as DeviceOpError
from kvactors.errors import InvalidFileError as InvalidFileError
from kvactors.errors import InvalidPointerError as InvalidPointerError
from kvactors.errors import InvalidSettingError as InvalidSettingError
from kvactors.errors import IPCError as IPCError
from kvactors.errors import KvactorsError as KvactorsError
from kvactors.errors import MailboxFullError as MailboxFullError
from kvactors.errors import MissingDependencyError as MissingDependencyError
from kvactors.errors import OperandTypeError as OperandTypeError
from kvactors.errors import ProtocolError as ProtocolError
from kvactors.errors import SettingTypeError as SettingTypeError
from kvactors.errors import TransferAbandonedError as TransferAbandonedError
from kvactors.errors import TransferFailedError as TransferFailedError
from kvactors.errors import TransferValidationError as TransferValidationError
from kvactors.errors import UnknownMessageError as UnknownMessageError
from kvactors.errors import UnsupportedOperationError as UnsupportedOperationError
from kvactors.runtime import Runtime as Runtime
from kvactors.runtime import get_runtime as get_runtime

__version__ = "0.1.0"

__all__ = (
    "ActorBrokenError",
    "ActorClosedError",
    "BackendUnavailableError",
    "DeadlineExceededError",
    "DeviceOpError",
    "Direction",
    "IPCError",
    "InvalidFileError",
    "InvalidPointerError",
    "InvalidSettingError",
    "KVFormat",
    "KvactorsError",
    "MailboxFullError",
    "MissingDependencyError",
    "OperandTypeError",
    "ProtocolError",
    "Runtime",
    "SettingTypeError",
    "ShapeDesc",
    "TransferAbandonedError",
    "TransferFailedError",
    "TransferRequest",
    "TransferValidationError",
    "UnknownMessageError",
    "UnsupportedOperationError",
    "__version__",
    "get_backend",
    "get_runtime",
    "probe_all",
)
