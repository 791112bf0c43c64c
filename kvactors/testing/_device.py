"""Fake device identity, the process's vendor device name, and the fake vendor error type.

torch registers one private device name per process, so the first fake installed claims it
(:func:`claim_device_name`; ``KVACTORS_FAKE_VENDOR=mlu|musa`` pins which kind may) and its
devices are genuine ``torch.device`` objects. A fake of the other kind falls back to
:class:`FakeDevice` (``type``, ``index``, ``"mlu:0"``).
"""

from __future__ import annotations

import os

import torch

__all__ = (
    "ENV_VENDOR",
    "FakeDevice",
    "FakeDeviceError",
    "claim_device_name",
    "parse_fake_device",
    "private_backend_named",
    "process_vendor",
)

ENV_VENDOR = "KVACTORS_FAKE_VENDOR"
_UNNAMED = "privateuseone"


class FakeDeviceError(RuntimeError):
    """An error raised by fake device work (injected, or a misuse the real driver reports)."""


class FakeDevice:
    """The device of a fake accelerator tensor or stream: ``type`` and ``index`` like torch."""

    __slots__ = ("_index", "_type")

    def __init__(self, type: str, index: int = 0) -> None:
        self._type = type
        self._index = index

    @property
    def type(self) -> str:
        """The device kind, e.g. ``"mlu"``."""
        return self._type

    @property
    def index(self) -> int:
        """The device ordinal."""
        return self._index

    def __str__(self) -> str:
        return f"{self._type}:{self._index}"

    def __repr__(self) -> str:
        return f"FakeDevice(type={self._type!r}, index={self._index})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FakeDevice):
            return (self._type, self._index) == (other._type, other._index)
        if isinstance(other, str):
            return other in (str(self), self._type if self._index == 0 else str(self))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._type, self._index))


def parse_fake_device(value: object, kind: str, current: int) -> int | None:
    """The device index ``value`` names on fake ``kind``, or None if it names something else.

    Accepts a :class:`FakeDevice`, a ``torch.device``, ``"kind"``/``"kind:i"`` strings, an
    int (an ordinal) and None (the current device ``current``).
    """
    if value is None:
        return current
    if isinstance(value, (FakeDevice, torch.device)):
        if value.type != kind:
            return None
        return current if value.index is None else value.index
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        name, _, idx = value.partition(":")
        if name != kind:
            return None
        return int(idx) if idx else current
    return None


def process_vendor() -> str | None:
    """The vendor kind owning this process's private torch device name, if any.

    That is the kind a fake can give real ``torch.device`` objects to: the name torch
    already carries, else the one ``KVACTORS_FAKE_VENDOR`` pins, else None (the first fake
    installed will claim it).
    """
    name = torch._C._get_privateuse1_backend_name()
    if name != _UNNAMED:
        return str(name)
    pinned = os.environ.get(ENV_VENDOR, "").strip().lower()
    return pinned or None


def private_backend_named() -> bool:
    """Whether torch's private backend has a name in this process (any kind: irreversible)."""
    return bool(torch._C._get_privateuse1_backend_name() != _UNNAMED)


def claim_device_name(kind: str) -> bool:
    """Make ``kind`` torch's private device name, if this process may; whether it is now.

    Renames the PrivateUse1 backend once per process (as torch_mlu / torch_musa do on
    import). Returns False when the name already belongs to another kind, or when
    ``KVACTORS_FAKE_VENDOR`` names another kind.
    """
    owner = process_vendor()
    if owner is not None and owner != kind:
        return False
    if torch._C._get_privateuse1_backend_name() == _UNNAMED:
        from torch.utils.backend_registration import rename_privateuse1_backend

        rename_privateuse1_backend(kind)
    return True
