"""The bad-input catalogue (docs/bad-inputs.md), one table row per input, each proven here.

Every row names an input, the exception class it must get and a fragment of its message.
The harness runs the call against fresh operands and then checks that every buffer the call
could have touched (paged KV and host chunks) is bit-for-bit unchanged and that nothing was
left in flight: a rejected input fails closed (design rule 5). A last test keeps the table
and the document in step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.actors.gather import TransferOperands
from kvactors.actors.group import DeviceActors
from kvactors.core.layouts import Direction
from kvactors.core.protocols.gather import Transfer
from kvactors.core.protocols.stream import Sync
from kvactors.errors import (
    ActorClosedError,
    DeadlineExceededError,
    InvalidPointerError,
    MailboxFullError,
    OperandTypeError,
    TransferValidationError,
    UnknownMessageError,
)
from kvactors.runtime import Runtime
from kvactors.testing.manual import ManualBackend
from tests.scenarios._kv import CHUNK, NH, NL, Snapshot, objects, paged, request, shape

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
D2H, H2D = Direction.D2H, Direction.H2D


@dataclasses.dataclass
class Env:
    """Fresh operands for one row, and the shared CPU runtime."""

    rt: Runtime
    src: list[torch.Tensor]
    objs: list[torch.Tensor]

    def transfer(self, req: Any, paged_: Any = None, objs: Any = None) -> Any:
        return self.rt.transfer(
            req, self.src if paged_ is None else paged_, self.objs if objs is None else objs
        )


@dataclasses.dataclass(frozen=True)
class Row:
    """One catalogue entry."""

    id: str
    exc: type[BaseException]
    fragment: str
    run: Callable[[Env], Any]


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _closed_runtime(env: Env) -> Any:
    rt = Runtime("cpu").start()
    rt.close()
    return rt.transfer(request(D2H, [0, 1]), env.src, env.objs)


def _past_deadline(env: Env) -> Any:
    # The deadline fails the ask, not the copy: the copy is already queued on the device
    # and completes later with its operands still owned. It gets its own chunk, so the
    # harness's buffers are only ever read.
    backend = ManualBackend()
    own = objects(1)
    with Runtime(backend) as rt:
        try:
            return rt.transfer(request(D2H, [1, 2]), env.src, own, timeout=0.05)
        except DeadlineExceededError:
            assert bool((own[0] == -1).all()), "the device had not run the copy yet"
            raise
        finally:
            assert backend.wait_for(lambda b: b.queued() == 1)
            backend.release()
            rt.synchronize()
            assert backend.use_after_free == 0
            assert not bool((own[0] == -1).all()), "the abandoned copy still completed"


async def _unknown_message_async() -> None:
    async with DeviceActors(ManualBackend(auto=True)) as dev:
        dev.gather.tell_nowait(Sync())  # type: ignore[arg-type]


async def _backlog_async(env: Env) -> None:
    backend = ManualBackend()
    async with DeviceActors(backend, capacity=2) as dev:
        accepted = [
            dev.gather.ask_nowait(
                Transfer(transfer_id=i, request=request(D2H, [i])),
                TransferOperands(env.src, objects(1)),
            )
            for i in range(2)
        ]
        try:
            dev.gather.ask_nowait(
                Transfer(transfer_id=9, request=request(D2H, [5])),
                TransferOperands(env.src, env.objs),
            )
        finally:
            # Release only once both copies reached the device queue (lanes launch them on
            # their own threads), or the release would run nothing and the asks would hang.
            assert await asyncio.to_thread(backend.wait_for, lambda b: b.queued() == 2)
            backend.release()
            await asyncio.gather(*accepted)


def _non_contiguous_object() -> torch.Tensor:
    return torch.full((2, NL, NH * 8, CHUNK), -1, dtype=torch.bfloat16).transpose(2, 3)


def _overlapping_paged(env: Env) -> list[torch.Tensor]:
    t = env.src[0]
    over = t.as_strided(t.shape, (0, *t.stride()[1:]))  # both planes alias plane 0
    return [over, env.src[1]]


def _split_kv_paged(env: Env) -> list[torch.Tensor]:
    # The NHD layers [2, NB, BS, NH, HS] seen as format 12's split form [NB, NH, BS, 2, HS]:
    # the K/V axis is the planes' (far apart), not one run with the head's elements.
    return [t.permute(1, 3, 2, 0, 4) for t in env.src]


ROWS: tuple[Row, ...] = (
    # ---- raw pointers -----------------------------------------------------------------
    Row(
        "zero-pointer",
        InvalidPointerError,
        "must be positive and non-zero",
        lambda e: e.rt.tensor_from_ptr(0, (4,), torch.float32),
    ),
    Row(
        "negative-pointer",
        InvalidPointerError,
        "must be positive and non-zero",
        lambda e: e.rt.tensor_from_ptr(-4096, (4,), torch.float32),
    ),
    Row(
        "shape-stride-mismatch",
        InvalidPointerError,
        "stride has 1 entries but shape has 2",
        lambda e: e.rt.tensor_from_ptr(e.objs[0].data_ptr(), (2, 4), torch.float32, stride=(4,)),
    ),
    Row(
        "pointer-wrong-device",
        InvalidPointerError,
        "cpu backend cannot view device",
        lambda e: e.rt.backend.tensor_from_ptr(
            e.objs[0].data_ptr(),
            (4,),
            torch.float32,  # type: ignore[call-arg]
            device="meta",
        ),
    ),
    # ---- runtime and actors -------------------------------------------------------------
    Row("closed-runtime", ActorClosedError, "runtime is closed", _closed_runtime),
    Row("ask-past-deadline", DeadlineExceededError, "no reply to Transfer within", _past_deadline),
    Row(
        "unknown-message",
        UnknownMessageError,
        "is not a message of this actor's protocol",
        lambda e: asyncio.run(_unknown_message_async()),
    ),
    Row(
        "mailbox-backlog",
        MailboxFullError,
        "mailbox full (2 messages)",
        lambda e: asyncio.run(_backlog_async(e)),
    ),
    # ---- request values -----------------------------------------------------------------
    Row(
        "chunk-not-multiple-of-block",
        TransferValidationError,
        "must be a positive multiple of shape_desc.bs",
        lambda e: e.transfer(request(D2H, [0, 1], chunk_size=CHUNK - 2)),
    ),
    Row(
        "chunk-size-zero",
        TransferValidationError,
        "chunk size must be positive",
        lambda e: e.transfer(request(D2H, [0, 1], chunk_size=0)),
    ),
    Row(
        "negative-skip",
        TransferValidationError,
        "skip_blocks must be >= 0",
        lambda e: e.transfer(request(H2D, [0, 1], skip_blocks=-1)),
    ),
    Row(
        "bad-direction",
        TransferValidationError,
        "direction must be 0 or 1",
        lambda e: e.transfer(request(2, [0, 1])),
    ),
    Row(
        "unknown-format",
        TransferValidationError,
        "unsupported engine KV format 5",
        lambda e: e.transfer(request(D2H, [0, 1], fmt=5)),
    ),
    Row(
        "ambiguous-2-byte-dtype",
        TransferValidationError,
        "element_size 2 is ambiguous",
        lambda e: e.transfer(request(D2H, [], shape=shape(dtype=None)), [], []),
    ),
    Row(
        "dtype-mismatch",
        TransferValidationError,
        "has dtype bfloat16, expected float16",
        lambda e: e.transfer(request(D2H, [0, 1], shape=shape(dtype="float16"))),
    ),
    Row(
        "layer-count-mismatch",
        TransferValidationError,
        "needs 3 paged tensors for nl=3, got 2",
        lambda e: e.transfer(request(D2H, [0, 1], shape=shape(nl=3))),
    ),
    Row(
        "paged-shape-mismatch",
        TransferValidationError,
        "paged tensor 0 has shape",
        lambda e: e.transfer(request(D2H, [0, 1], shape=shape(nb=12))),
    ),
    Row(
        "paged-wrong-device",
        TransferValidationError,
        "paged tensor 0 is on meta",
        lambda e: e.transfer(request(D2H, [0, 1]), [_meta_like(t) for t in e.src]),
    ),
    Row(
        "paged-overlapping",
        TransferValidationError,
        "has overlapping memory",
        lambda e: e.transfer(request(H2D, [0, 1]), _overlapping_paged(e)),
    ),
    Row(
        "fused-kv-axes-not-one-run",
        TransferValidationError,
        "cannot be merged without a copy",
        lambda e: e.transfer(
            request(H2D, [0, 1], fmt=12, shape=shape(kv_size=1, hs=16)), _split_kv_paged(e)
        ),
    ),
    Row(
        "block-id-out-of-range",
        TransferValidationError,
        "block id 16 is out of range [0, 16)",
        lambda e: e.transfer(request(H2D, [0, 16])),
    ),
    Row(
        "block-id-negative",
        TransferValidationError,
        "block id -1 is out of range",
        lambda e: e.transfer(request(D2H, [-1, 2])),
    ),
    Row(
        "block-id-not-int",
        OperandTypeError,
        "block_ids must hold ints",
        lambda e: e.transfer(request(D2H, [1.0, 2])),  # type: ignore[list-item]
    ),
    Row(
        "duplicate-ids-on-scatter",
        TransferValidationError,
        "duplicate block ids in an H2D transfer",
        lambda e: e.transfer(request(H2D, [3, 3])),
    ),
    Row(
        "object-wrong-shape",
        TransferValidationError,
        "object 0 has shape",
        lambda e: e.transfer(
            request(D2H, [0, 1]),
            None,
            [torch.zeros(2, NL, CHUNK + 4, NH * 8, dtype=torch.bfloat16)],
        ),
    ),
    Row(
        "object-wrong-dtype",
        TransferValidationError,
        "object 0 has dtype float16",
        lambda e: e.transfer(
            request(D2H, [0, 1]), None, [torch.zeros(2, NL, CHUNK, NH * 8, dtype=torch.float16)]
        ),
    ),
    Row(
        "object-not-cpu",
        TransferValidationError,
        "host chunks must be CPU tensors",
        lambda e: e.transfer(request(D2H, [0, 1]), None, [_meta_like(e.objs[0])]),
    ),
    Row(
        "object-not-contiguous",
        TransferValidationError,
        "object 0 is not contiguous",
        lambda e: e.transfer(request(D2H, [0, 1]), None, [_non_contiguous_object()]),
    ),
    Row(
        "objects-not-a-list",
        OperandTypeError,
        "objects must be a sequence of tensors",
        lambda e: e.transfer(request(D2H, [0, 1]), None, e.objs[0]),
    ),
)


@pytest.fixture(scope="module")
def runtime() -> Iterator[Runtime]:
    with Runtime("cpu") as rt:
        yield rt


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_rejected_and_changes_nothing(runtime: Runtime, row: Row) -> None:
    env = Env(rt=runtime, src=paged(7), objs=objects(1))
    snap = Snapshot.of(env.src, env.objs)
    before = runtime.statistics()
    with pytest.raises(row.exc, match=re.escape(row.fragment)):
        row.run(env)
    assert snap.unchanged(), f"{row.id}: a rejected call changed a buffer"
    after = runtime.statistics()
    assert after.inflight == 0
    assert after.transfers_ok == before.transfers_ok
    assert after.transfers_failed == before.transfers_failed


def test_catalogue_document_lists_exactly_the_tested_rows() -> None:
    text = DOC.read_text(encoding="utf-8")
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(r.id for r in ROWS)
    for row in ROWS:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{row.id}` |"))
        assert row.exc.__name__ in line, row.id
        assert row.fragment in line.replace("\\|", "|"), row.id
