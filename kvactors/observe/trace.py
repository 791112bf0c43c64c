"""Record a runtime's messages to a file, and replay them to reproduce a run.

:class:`TraceRecorder` is an observer: per admitted call a ``call`` entry (admission sequence,
time, the encoded wire message, stream handle, operand shapes and dtype, never data) and a
``done`` entry (duration, error), as length-prefixed msgpack flushed per entry. :func:`replay`
re-sends them to a fresh runtime with zero-filled operands of the recorded shapes, keeping the
recorded overlap (call ``i`` waits for the calls that had finished before it started), and
compares outcomes per call.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol

import msgspec
import torch

from kvactors.core.protocols.codec import GATHER_REQUESTS, encode
from kvactors.core.protocols.gather import Fence, Ping, Transfer
from kvactors.errors import InvalidFileError
from kvactors.observe import observe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvactors.observe import Call
    from kvactors.runtime import Runtime

__all__ = (
    "DeviceMemory",
    "OperandShapes",
    "ReplayReport",
    "TraceEntry",
    "TraceHeader",
    "TraceRecorder",
    "iter_messages",
    "read_trace",
    "replay",
)


class DeviceMemory(Protocol):
    """Where :func:`replay` allocates synthetic paged memory (``kvactors.cli``'s device env)."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of ``shape`` in device memory."""
        ...


_FORMAT = "kvactors-trace/1"
_RECORDED = frozenset({"transfer", "fence", "ping", "synchronize"})
_LEN = struct.Struct("<I")


class TraceHeader(msgspec.Struct, frozen=True, kw_only=True):
    """First record of a trace file."""

    format: str = _FORMAT
    device: str
    created: float


class OperandShapes(msgspec.Struct, frozen=True, kw_only=True):
    """The operands of a transfer without their data: structure, shapes, dtype."""

    paged_kind: Literal["tensor", "list", "kv_list"]
    """``tensor`` (one cross-layer tensor), ``list`` (per layer) or ``kv_list``."""
    paged: list[list[int]]
    objects: list[list[int]]
    dtype: str


class TraceEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One ``call`` (submitted) or ``done`` (returned) record."""

    kind: Literal["call", "done"]
    seq: int
    t: float
    op: str
    message: bytes = b""
    stream_handle: int = 0
    operands: OperandShapes | None = None
    seconds: float = 0.0
    error: str = ""


def _shapes(paged: Any, objects: Any) -> OperandShapes | None:
    kind: Literal["tensor", "list", "kv_list"]
    try:
        if isinstance(paged, torch.Tensor):
            kind, tensors = "tensor", [paged]
        elif paged and not isinstance(paged[0], torch.Tensor):
            kind, tensors = "kv_list", [*paged[0], *paged[1]]
        else:
            kind, tensors = "list", list(paged)
        objs = list(objects)
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        return OperandShapes(
            paged_kind=kind,
            paged=[list(t.shape) for t in tensors],
            objects=[list(o.shape) for o in objs],
            dtype=dtype,
        )
    except Exception:  # an operand the runtime will reject anyway; record no shapes
        return None


class TraceRecorder:
    """Writes a trace of every observed call to ``path``; attach with :meth:`attach`."""

    def __init__(self, path: str, *, device: str = "") -> None:
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._detach: Callable[[], None] | None = None
        self.entries = 0
        self._write(TraceHeader(device=device, created=time.time()))

    def _write(self, rec: msgspec.Struct) -> None:
        data = msgspec.msgpack.encode(rec)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(_LEN.pack(len(data)) + data)
            self._file.flush()
            self.entries += 1

    def attach(self, rt: Runtime) -> TraceRecorder:
        """Start recording ``rt``'s calls."""
        self._detach = observe(rt, self)
        return self

    def call_started(self, call: Call) -> None:
        """Observer hook: record the admitted message (transfers, fences, pings, syncs)."""
        if call.op not in _RECORDED:
            return
        ops = _shapes(call.paged, call.objects) if call.op == "transfer" else None
        self._write(
            TraceEntry(
                kind="call",
                seq=call.seq,
                t=call.started - self._t0,
                op=call.op,
                message=encode(call.message),
                stream_handle=call.stream_handle,
                operands=ops,
            )
        )

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        """Observer hook: record the outcome."""
        if call.op not in _RECORDED:
            return
        self._write(
            TraceEntry(
                kind="done",
                seq=call.seq,
                t=call.started + seconds - self._t0,
                op=call.op,
                seconds=seconds,
                error="" if error is None else type(error).__name__,
            )
        )

    def close(self) -> None:
        """Detach and close the file (idempotent)."""
        if self._detach is not None:
            self._detach()
            self._detach = None
        with self._lock:
            self._file.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str) -> tuple[TraceHeader, list[TraceEntry]]:
    """Read a trace file (a truncated last record is ignored).

    Raises:
        InvalidFileError: not a kvactors trace (a ValueError).
    """
    with open(path, "rb") as f:
        data = f.read()
    recs: list[bytes] = []
    pos = 0
    while pos + 4 <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        if pos + 4 + n > len(data):
            break
        recs.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    try:
        header = msgspec.msgpack.decode(recs[0], type=TraceHeader)
    except (IndexError, msgspec.DecodeError) as exc:
        raise InvalidFileError(f"{path}: not a kvactors trace", path=path) from exc
    if header.format != _FORMAT:
        raise InvalidFileError(
            f"{path}: trace format {header.format!r}, expected {_FORMAT!r}", path=path
        )
    dec = msgspec.msgpack.Decoder(TraceEntry)
    return header, [dec.decode(r) for r in recs[1:]]


class ReplayReport(msgspec.Struct, kw_only=True):
    """What a replay did; ``ok`` when every call had the recorded outcome."""

    calls: int = 0
    transfers: int = 0
    bytes_moved: int = 0
    outcome_mismatches: list[str] = msgspec.field(default_factory=list)
    seconds: float = 0.0
    recorded_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every replayed call ended as it did when recorded."""
        return not self.outcome_mismatches


class _Operands:
    """Synthetic operands, one set per distinct shape signature."""

    def __init__(self, env: DeviceMemory | None) -> None:
        self.env = env
        self.cache: dict[Any, Any] = {}

    def _dev(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        if self.env is None:
            return torch.zeros(shape, dtype=dtype)
        return self.env.zeros(tuple(shape), dtype)

    def get(self, s: OperandShapes) -> tuple[Any, list[torch.Tensor]]:
        key = msgspec.msgpack.encode(s)
        if key not in self.cache:
            dtype = getattr(torch, s.dtype)
            tensors = [self._dev(shape, dtype) for shape in s.paged]
            paged: Any
            if s.paged_kind == "tensor":
                paged = tensors[0]
            elif s.paged_kind == "kv_list":
                half = len(tensors) // 2
                paged = [tensors[:half], tensors[half:]]
            else:
                paged = tensors
            objects = [torch.zeros(shape, dtype=dtype) for shape in s.objects]
            self.cache[key] = (paged, objects)
        result: tuple[Any, list[torch.Tensor]] = self.cache[key]
        return result


async def _replay(
    rt: Runtime, entries: list[TraceEntry], env: DeviceMemory | None, report: ReplayReport
) -> None:
    calls = [e for e in entries if e.kind == "call"]
    done = {e.seq: e for e in entries if e.kind == "done"}
    operands = _Operands(env)
    tasks: dict[int, asyncio.Task[None]] = {}

    def submit(e: TraceEntry) -> asyncio.Future[Any]:
        # Called in trace order: the a* methods queue their message when called, so the
        # mailbox order of the replay is the trace order (a recorded fence after a store is
        # queued after it). Only the waiting happens in a task.
        if e.op == "transfer":
            msg = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg, Transfer)
            assert e.operands is not None
            paged, objects = operands.get(e.operands)
            return asyncio.ensure_future(
                rt.atransfer(msg.request, paged, objects, stream_handle=e.stream_handle)
            )
        if e.op == "fence":
            msg_f = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg_f, Fence)
            return asyncio.ensure_future(rt.afence(msg_f.block_ids))
        if e.op == "ping":
            msg_p = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg_p, Ping)
            return asyncio.ensure_future(rt.aping(msg_p.seq))
        return asyncio.get_running_loop().run_in_executor(None, rt.synchronize, e.stream_handle)

    async def one(e: TraceEntry, submitted: asyncio.Future[Any] | Exception) -> None:
        error = ""
        try:
            if isinstance(submitted, Exception):
                raise submitted
            r = await submitted
            if e.op == "transfer":
                report.transfers += 1
                report.bytes_moved += r.nbytes
        except Exception as exc:
            error = type(exc).__name__
        want = done[e.seq].error if e.seq in done else ""
        if error != want:
            report.outcome_mismatches.append(
                f"call {e.seq} ({e.op}): recorded {want or 'ok'}, replayed {error or 'ok'}"
            )

    for e in calls:
        for seq, task in list(tasks.items()):
            d = done.get(seq)
            if d is not None and d.t <= e.t:
                await task
                del tasks[seq]
        submitted: asyncio.Future[Any] | Exception
        try:
            submitted = submit(e)
        except Exception as exc:  # refused before it was queued: replayed as that outcome
            submitted = exc
        tasks[e.seq] = asyncio.ensure_future(one(e, submitted))
        report.calls += 1
    if tasks:
        await asyncio.gather(*tasks.values())


def replay(path: str, rt: Runtime, *, env: DeviceMemory | None = None) -> ReplayReport:
    """Replay the trace at ``path`` on ``rt`` (started if needed); see the module docstring.

    Args:
        path: A file written by :class:`TraceRecorder`.
        rt: A fresh runtime (its device decides where synthetic paged memory lives).
        env: How to allocate device memory (default: host tensors, for the ``cpu`` backend).
    """
    _, entries = read_trace(path)
    report = ReplayReport()
    if entries:
        report.recorded_seconds = max(e.t for e in entries)
    t0 = time.perf_counter()
    asyncio.run(_replay(rt, entries, env, report))
    report.seconds = time.perf_counter() - t0
    return report


def iter_messages(path: str) -> Iterator[tuple[float, msgspec.Struct]]:
    """``(t, message)`` of every recorded call that is a GatherActor message, in order."""
    _, entries = read_trace(path)
    for e in entries:
        if e.kind == "call" and e.op != "synchronize":
            yield e.t, GATHER_REQUESTS.decode(e.message)
