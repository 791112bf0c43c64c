"""Fake device identity and the fake vendor error type.

Theory of operation. torch can register exactly one private device name per process
(``torch.utils.rename_privateuse1_backend``), so ``torch.device("mlu")`` and
``torch.device("musa")`` cannot both parse in one test process. The fakes therefore never
build a real ``torch.device`` for a fake accelerator: :class:`FakeDevice` is a small value
object with the attributes backend code reads (``type``, ``index``) and the string form
torch uses (``"mlu:0"``). It compares equal to another FakeDevice and to that string.
"""

from __future__ import annotations

__all__ = ("FakeDevice", "FakeDeviceError", "parse_fake_device")


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

    Accepts a :class:`FakeDevice`, ``"kind"``/``"kind:i"`` strings, an int (an ordinal) and
    None (the current device ``current``).
    """
    if value is None:
        return current
    if isinstance(value, FakeDevice):
        return value.index if value.type == kind else None
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
