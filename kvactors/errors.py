"""The single exception hierarchy of kvactors.

Every exception raised on purpose by kvactors derives from :class:`KvactorsError`. Leaves
that LMCache callers catch by builtin type also derive from ``ValueError``, ``TypeError``,
``NotImplementedError`` or ``RuntimeError``, so the adapter can surface them unchanged.
Context (which actor, which device, which field) rides as attributes, never only in text.
"""

from __future__ import annotations

__all__ = (
    "ActorBrokenError",
    "ActorClosedError",
    "BackendUnavailableError",
    "DeadlineExceededError",
    "DeviceOpError",
    "IPCError",
    "InvalidPointerError",
    "KvactorsError",
    "MailboxFullError",
    "OperandTypeError",
    "ProtocolError",
    "TransferFailedError",
    "TransferValidationError",
    "UnknownMessageError",
    "UnsupportedOperationError",
)


class KvactorsError(Exception):
    """Base of every kvactors exception; never raised directly."""


class ActorClosedError(KvactorsError, RuntimeError):
    """The actor (or the runtime) was stopped on purpose; the request was not served."""

    def __init__(self, message: str, *, actor: str) -> None:
        super().__init__(f"{actor}: {message}")
        self.actor = actor


class ActorBrokenError(KvactorsError, RuntimeError):
    """The actor died under the caller; ``__cause__`` (and ``cause``) holds why."""

    def __init__(self, message: str, *, actor: str, cause: BaseException | None) -> None:
        super().__init__(f"{actor}: {message}" + (f" (cause: {cause!r})" if cause else ""))
        self.actor = actor
        self.cause = cause
        self.__cause__ = cause


class MailboxFullError(KvactorsError, RuntimeError):
    """A non-waiting send found the bounded mailbox full (backpressure); nothing was queued."""

    def __init__(self, *, actor: str, capacity: int) -> None:
        super().__init__(f"{actor}: mailbox full ({capacity} messages); retry or await send()")
        self.actor = actor
        self.capacity = capacity


class DeadlineExceededError(KvactorsError, TimeoutError):
    """An ask did not get its reply before its deadline."""

    def __init__(self, *, actor: str, message_type: str, timeout: float) -> None:
        super().__init__(f"{actor}: no reply to {message_type} within {timeout:.3f}s")
        self.actor = actor
        self.message_type = message_type
        self.timeout = timeout


class UnknownMessageError(KvactorsError, TypeError):
    """A message whose type is not in the receiving actor's protocol."""

    def __init__(self, *, actor: str, message_type: str) -> None:
        super().__init__(f"{actor}: {message_type} is not a message of this actor's protocol")
        self.actor = actor
        self.message_type = message_type


class ProtocolError(KvactorsError, RuntimeError):
    """A message that is legal in general but illegal in the actor's current state."""

    def __init__(self, message: str, *, actor: str, state: str) -> None:
        super().__init__(f"{actor} [{state}]: {message}")
        self.actor = actor
        self.state = state


class TransferValidationError(KvactorsError, ValueError):
    """A transfer request failed validation; no memory was touched."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class OperandTypeError(KvactorsError, TypeError):
    """An operand has the wrong Python type or structure; no memory was touched."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidPointerError(KvactorsError, ValueError):
    """A raw pointer view was refused (null/negative pointer, bad shape/stride, wrong device)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnsupportedOperationError(KvactorsError, NotImplementedError):
    """The entry point is deliberately unsupported on this backend (e.g. MLU raw pointers)."""

    def __init__(self, message: str, *, backend: str) -> None:
        super().__init__(f"{backend}: {message}")
        self.backend = backend


class BackendUnavailableError(KvactorsError, RuntimeError):
    """The selected backend cannot run here; ``reason`` says what is missing."""

    def __init__(self, *, backend: str, reason: str) -> None:
        super().__init__(f"backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason


class DeviceOpError(KvactorsError, RuntimeError):
    """A device, stream or event call failed (translated from the vendor error)."""

    def __init__(self, message: str, *, device: str, op: str) -> None:
        super().__init__(f"{device} {op}: {message}")
        self.device = device
        self.op = op


class IPCError(KvactorsError, RuntimeError):
    """Exporting, opening or closing an IPC handle failed."""

    def __init__(self, message: str, *, handle: str | None = None) -> None:
        super().__init__(message)
        self.handle = handle


class TransferFailedError(KvactorsError, RuntimeError):
    """A validated transfer failed while it ran; its destination must be treated as invalid."""

    def __init__(self, message: str, *, transfer_id: int, device: str) -> None:
        super().__init__(f"transfer {transfer_id} on {device} failed: {message}")
        self.transfer_id = transfer_id
        self.device = device
