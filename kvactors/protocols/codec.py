"""Cross-process codec: msgpack with one typed decoder per protocol.

In-process, messages travel as objects (no encoding). Across a process boundary they are
msgpack-encoded; the wire types hold ints, strings, bytes and nested Structs only, so a tensor
or a raw pointer cannot be encoded by accident: encoding anything else raises.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from kvactors.protocols.gather import GatherReply, GatherRequest
from kvactors.protocols.ipc import IPCReply, IPCRequest
from kvactors.protocols.stream import StreamReply, StreamRequest

__all__ = (
    "GATHER_REPLIES",
    "GATHER_REQUESTS",
    "IPC_REPLIES",
    "IPC_REQUESTS",
    "STREAM_REPLIES",
    "STREAM_REQUESTS",
    "WireCodec",
    "encode",
)

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """Encode one message for the wire."""
    return _ENCODER.encode(msg)


class WireCodec(Generic[T]):
    """A typed msgpack decoder for one protocol union, built once."""

    def __init__(self, union: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def decode(self, data: bytes) -> T:
        """Decode bytes into a message of this protocol; raises ``msgspec.ValidationError``."""
        return self._decoder.decode(data)


STREAM_REQUESTS: WireCodec[StreamRequest] = WireCodec(StreamRequest)
STREAM_REPLIES: WireCodec[StreamReply] = WireCodec(StreamReply)
GATHER_REQUESTS: WireCodec[GatherRequest] = WireCodec(GatherRequest)
GATHER_REPLIES: WireCodec[GatherReply] = WireCodec(GatherReply)
IPC_REQUESTS: WireCodec[IPCRequest] = WireCodec(IPCRequest)
IPC_REPLIES: WireCodec[IPCReply] = WireCodec(IPCReply)
