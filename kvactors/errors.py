"""The single exception hierarchy of kvactors.

Every exception raised on purpose by kvactors derives from :class:`KvactorsError`. Leaves
that LMCache callers catch by builtin type also derive from ``ValueError``, ``TypeError``,
``NotImplementedError`` or ``RuntimeError``, so the adapter can surface them unchanged.
Context (which actor, which device, which field) rides as attributes, never only in text.

Foreign errors (vendor runtimes, torch, the OS) cross into kvactors at one place each edge,
through one helper: :func:`translate` (or its context-manager form :func:`translating`) turns
them into the kvactors leaf that says what failed, keeps the original as ``__cause__``, and
lets kvactors errors pass unchanged. ``tests/core/test_errors.py`` scans the source so that every
``raise`` in ``kvactors/`` and in the LMCache adapter names a kvactors error (``AssertionError``
marks an invariant).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = (
    "ActorBrokenError",
    "ActorClosedError",
    "BackendUnavailableError",
    "DeadlineExceededError",
    "DeviceOpError",
    "IPCError",
    "InvalidFileError",
    "InvalidPointerError",
    "InvalidSettingError",
    "KvactorsError",
    "MailboxFullError",
    "MissingDependencyError",
    "OperandTypeError",
    "ProtocolError",
    "SettingTypeError",
    "TransferAbandonedError",
    "TransferFailedError",
    "TransferValidationError",
    "UnknownMessageError",
    "UnsupportedOperationError",
    "transfer_failed",
    "translate",
    "translating",
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


class TransferAbandonedError(KvactorsError, RuntimeError):
    """A close stopped waiting for a transfer that was already handed to its stream: the copy
    may still land. Do not reuse or free its memory before the stream was synchronized (or the
    process ended). Distinct from :class:`ActorClosedError`, which means nothing was enqueued."""

    def __init__(self, message: str, *, transfer_id: int, device: str) -> None:
        super().__init__(f"transfer {transfer_id} on {device} abandoned: {message}")
        self.transfer_id = transfer_id
        self.device = device


class InvalidSettingError(KvactorsError, ValueError):
    """A setting of the runtime, a backend or a tool has a bad value (nothing was started)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class SettingTypeError(KvactorsError, TypeError):
    """A setting of the runtime, a backend or a tool has the wrong type."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class InvalidFileError(KvactorsError, ValueError):
    """A file is not what kvactors wrote (a trace, a KV dump) or has an unknown format."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class MissingDependencyError(KvactorsError, ImportError):
    """An optional dependency of a feature is not installed; the message says how to add it."""

    def __init__(self, message: str, *, package: str) -> None:
        super().__init__(message)
        self.package = package


def translate(err: BaseException, make: Callable[[str], KvactorsError]) -> BaseException:
    """The kvactors error for ``err``: itself if it is one, else ``make(message)`` caused by it.

    ``make`` builds the leaf that says what failed (``DeviceOpError`` for a device call,
    ``TransferFailedError`` for a transfer); the message is the foreign error's text (or its
    type name when it has none).
    """
    if isinstance(err, KvactorsError):
        return err
    exc = make(str(err) or type(err).__name__)
    exc.__cause__ = err
    return exc


def transfer_failed(err: BaseException, transfer_id: int, device: str) -> BaseException:
    """:func:`translate` for a transfer: ``err`` itself if it is a kvactors error, else a
    :class:`TransferFailedError` of ``transfer_id`` on ``device`` caused by it."""
    return translate(err, lambda m: TransferFailedError(m, transfer_id=transfer_id, device=device))


@contextlib.contextmanager
def translating(
    make: Callable[[str], KvactorsError],
    foreign: tuple[type[BaseException], ...] = (RuntimeError, OSError),
) -> Iterator[None]:
    """Raise :func:`translate`'s error for ``foreign`` errors raised in the block."""
    try:
        yield
    except KvactorsError:
        raise
    except foreign as err:
        raise translate(err, make) from err
