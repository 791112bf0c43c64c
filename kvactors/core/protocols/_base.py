"""The base every protocol message derives from."""

from __future__ import annotations

import msgspec

__all__ = ("Message",)


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every kvactors message: frozen, keyword-only, tagged by class name.

    Messages carry no tensors and no raw pointers; tensors ride beside a message as an
    operand bundle owned by the receiving actor.
    """
