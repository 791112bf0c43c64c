"""Every protocol message is wire-safe (it round-trips through msgpack with its union's typed
decoder); tensors and pointers cannot ride along."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from kvactors.core.layouts import ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.core.protocols import codec, gather, ipc, stream
from kvactors.devices.base import IPCHandle

_shape = ShapeDesc(kv_size=2, nl=2, nb=8, bs=4, nh=2, hs=8, element_size=2, dtype="bfloat16")
_req = TransferRequest(fmt=1, direction=1, block_ids=(1, 2, 3), chunk_size=8, shape=_shape)
_handle = IPCHandle(
    backend="cpu", name="psm_x", dtype="float16", shape=(2, 3), stride=(3, 1), nbytes=12
)
_event = stream.EventRecord(
    event_type="finish", session_id="s1", wall_ts=1.5, str_fields={"a": "b"}, int_fields={"n": 3}
)

CASES = [
    (stream.StreamRequest, stream.Launch(transfer_id=1, nbytes=64)),
    (stream.StreamRequest, stream.RecordCompletion(kind="finish_write", payload=b"\x01\x02")),
    (stream.StreamRequest, stream.RecordEvent(record=_event)),
    (stream.StreamRequest, stream.Sync()),
    (stream.StreamReply, stream.Launched(transfer_id=1, nbytes=64)),
    (stream.StreamReply, stream.Synced(completed=4)),
    (gather.GatherRequest, gather.Transfer(transfer_id=3, request=_req, stream_handle=7)),
    (gather.GatherRequest, gather.Fence(block_ids=(1, 2))),
    (gather.GatherRequest, gather.Ping(seq=9)),
    (gather.GatherReply, gather.TransferDone(transfer_id=3, nbytes=10, blocks=2)),
    (gather.GatherReply, gather.Fenced(block_ids=(1,), waited_for=1)),
    (gather.GatherReply, gather.Pong(seq=9)),
    (ipc.IPCRequest, ipc.OpenHandle(context_id=1, handle=_handle)),
    (ipc.IPCRequest, ipc.CloseContext(context_id=1, stream_handles=(0, 5))),
    (ipc.IPCReply, ipc.Opened(context_id=1)),
    (ipc.IPCReply, ipc.ContextClosed(context_id=1, owners_closed=1)),
]


@pytest.mark.parametrize(("union", "msg"), CASES, ids=[type(m).__name__ for _, m in CASES])
def test_round_trip(union: Any, msg: msgspec.Struct) -> None:
    data = codec.encode(msg)
    assert msgspec.msgpack.Decoder(union).decode(data) == msg


def test_every_protocol_message_has_a_case() -> None:
    covered = {type(m) for _, m in CASES}
    for union in (
        stream.StreamRequest,
        stream.StreamReply,
        gather.GatherRequest,
        gather.GatherReply,
        ipc.IPCRequest,
        ipc.IPCReply,
    ):
        assert set(union.__args__) <= covered


def test_messages_are_frozen() -> None:
    msg = gather.Fence(block_ids=(1,))
    with pytest.raises(AttributeError):
        msg.block_ids = (2,)  # type: ignore[misc]


def test_tensor_cannot_be_encoded() -> None:
    with pytest.raises(TypeError):
        codec.encode(stream.RecordCompletion(kind="x", payload=torch.zeros(2)))  # type: ignore[arg-type]


def test_wrong_protocol_is_rejected_on_decode() -> None:
    data = codec.encode(stream.Sync())
    with pytest.raises(msgspec.ValidationError):
        codec.GATHER_REQUESTS.decode(data)
