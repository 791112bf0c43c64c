"""Wire codec: msgpack, for the messages a trace records and replays.

In-process, messages travel as objects (no encoding). A trace (:mod:`kvactors.observe.trace`) stores
each GatherActor request encoded; the wire types hold ints, strings, bytes and nested Structs
only, so a tensor or a raw pointer cannot be encoded by accident: encoding anything else
raises.
"""

from __future__ import annotations

import msgspec

from kvactors.core.protocols.gather import GatherRequest

__all__ = ("GATHER_REQUESTS", "encode")

_ENCODER = msgspec.msgpack.Encoder()

GATHER_REQUESTS: msgspec.msgpack.Decoder[GatherRequest] = msgspec.msgpack.Decoder(GatherRequest)
"""The typed decoder of GatherActor requests (raises ``msgspec.ValidationError``)."""


def encode(msg: msgspec.Struct) -> bytes:
    """Encode one message for the wire."""
    return _ENCODER.encode(msg)
