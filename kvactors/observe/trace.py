"""Record a runtime's messages to a file, and replay them to reproduce a run.

:class:`TraceRecorder` is an observer: per admitted call a ``call`` entry (admission sequence,
time, the encoded wire message, stream identity, operand shapes and dtype, never data) and a
``done`` entry (duration, error), as length-prefixed msgpack flushed per entry. :func:`replay`
re-sends them to a fresh runtime with zero-filled operands of the recorded shapes, keeping the
recorded overlap (call ``i`` waits for the calls that had finished before it started), and
compares outcomes per call. :func:`read_trace` checks every record before replay acts on it
(types, message kinds, dtypes, stream numbering, operand sizes against their request, and the
bytes of all synthetic operands against a cap the file does not control,
:data:`DEFAULT_MAX_BYTES`) and raises :class:`~kvactors.errors.InvalidFileError` for a damaged or
hostile file before anything is allocated.

Theory of operation. A stream handle is process-local (on MLU and MUSA a native queue
pointer), so a trace never holds one: the recorder numbers streams in the order of their first
use (handle 0, the default stream, stays 0; the first borrowed stream is 1, the next new one 2)
and writes that identity both in the entry and inside the encoded ``Transfer``. Replay makes
one stream of its own per identity (``Backend.new_stream``) and passes that stream's handle,
so work recorded on two streams runs on two streams again. The header records the backend
settings the recorded transfers depended on (:data:`BACKEND_SETTINGS`, e.g. MLU's
``layout_source``); :func:`replay_backend` builds a backend with the same settings.
"""

from __future__ import annotations

import asyncio
import math
import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Protocol

import msgspec
import torch

from kvactors.core.protocols.codec import GATHER_REQUESTS, encode
from kvactors.core.protocols.gather import Fence, Ping, Transfer
from kvactors.devices import get_backend
from kvactors.errors import InvalidFileError
from kvactors.observe import observe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from kvactors.devices.base import Backend, StreamLike
    from kvactors.devices.mlu.layouts import LayoutSource
    from kvactors.observe import Call
    from kvactors.runtime import Runtime

__all__ = (
    "BACKEND_SETTINGS",
    "DEFAULT_MAX_BYTES",
    "DeviceMemory",
    "OperandShapes",
    "ReplayReport",
    "TraceEntry",
    "TraceHeader",
    "TraceRecorder",
    "iter_messages",
    "read_trace",
    "replay",
    "replay_backend",
)


class DeviceMemory(Protocol):
    """Where :func:`replay` allocates synthetic paged memory (``kvactors.cli``'s device env)."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of ``shape`` in device memory."""
        ...


_FORMAT = "kvactors-trace/2"
_RECORDED = frozenset({"transfer", "fence", "ping", "synchronize"})
_LEN = struct.Struct("<I")

DEFAULT_MAX_BYTES = 256 * 2**20
"""The default cap on the synthetic operands one replay allocates (bytes, all calls together);
``kvactors replay --max-bytes`` and ``read_trace(max_bytes=...)`` change it."""

BACKEND_SETTINGS: Mapping[str, tuple[str, ...]] = {"mlu": ("layout_source",)}
"""Per device kind, the backend attributes that decide whether a recorded transfer is accepted
(recorded in :attr:`TraceHeader.settings` when set, applied by :func:`replay_backend`)."""


class TraceHeader(msgspec.Struct, frozen=True, kw_only=True):
    """First record of a trace file."""

    format: str = _FORMAT
    device: str
    created: float
    settings: dict[str, str] = msgspec.field(default_factory=dict)
    """The recording backend's :data:`BACKEND_SETTINGS` (name -> value, ``""`` for unset);
    empty when the recorder was not attached with :meth:`TraceRecorder.attach`."""


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
    """The stream's identity in this trace, never a process's handle: 0 is the default stream,
    ``k`` the ``k``-th distinct stream the recorded calls used (order of first use)."""
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
    """Writes a trace of every observed call to ``path``; attach with :meth:`attach`.

    Args:
        path: The trace file (created, or truncated).
        device: The device kind written in the header (default: the attached runtime's).
    """

    def __init__(self, path: str, *, device: str = "") -> None:
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._detach: Callable[[], None] | None = None
        self._device = device
        self._header = False
        self._streams: dict[int, int] = {0: 0}  # process-local handle -> trace identity
        self.entries = 0

    def _header_locked(self, device: str, settings: dict[str, str]) -> None:
        if not self._header and not self._file.closed:
            self._header = True
            self._put_locked(TraceHeader(device=device, created=time.time(), settings=settings))

    def _write_locked(self, rec: msgspec.Struct) -> None:
        # A recorder used without attach() (Runtime(observer=...)) knows no backend settings.
        self._header_locked(self._device, {})
        self._put_locked(rec)

    def _put_locked(self, rec: msgspec.Struct) -> None:
        if self._file.closed:
            return
        data = msgspec.msgpack.encode(rec)
        self._file.write(_LEN.pack(len(data)) + data)
        self._file.flush()
        self.entries += 1

    def attach(self, rt: Runtime) -> TraceRecorder:
        """Start recording ``rt``'s calls (the header takes its backend's settings)."""
        backend = rt.backend
        settings = {  # "" records a setting left unset (None)
            name: "" if (value := getattr(backend, name, None)) is None else str(value)
            for name in BACKEND_SETTINGS.get(backend.kind, ())
        }
        with self._lock:
            self._header_locked(self._device or backend.kind, settings)
        self._detach = observe(rt, self)
        return self

    def _identity(self, handle: int) -> int:
        # Under the lock, with the write: identities appear in the file in order of first use.
        ident = self._streams.get(handle)
        if ident is None:
            ident = self._streams[handle] = len(self._streams)
        return ident

    def call_started(self, call: Call) -> None:
        """Observer hook: record the admitted message (transfers, fences, pings, syncs)."""
        if call.op not in _RECORDED:
            return
        ops = _shapes(call.paged, call.objects) if call.op == "transfer" else None
        with self._lock:
            stream = self._identity(call.stream_handle)
            msg = call.message
            if isinstance(msg, Transfer):  # the raw handle never reaches encode()
                msg = msgspec.structs.replace(msg, stream_handle=stream)
            self._write_locked(
                TraceEntry(
                    kind="call",
                    seq=call.seq,
                    t=call.started - self._t0,
                    op=call.op,
                    message=encode(msg),
                    stream_handle=stream,
                    operands=ops,
                )
            )

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        """Observer hook: record the outcome."""
        if call.op not in _RECORDED:
            return
        done = TraceEntry(
            kind="done",
            seq=call.seq,
            t=call.started + seconds - self._t0,
            op=call.op,
            seconds=seconds,
            error="" if error is None else type(error).__name__,
        )
        with self._lock:
            self._write_locked(done)

    def close(self) -> None:
        """Detach and close the file (idempotent)."""
        if self._detach is not None:
            self._detach()
            self._detach = None
        with self._lock:
            self._header_locked(self._device, {})
            self._file.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(
    path: str, *, max_bytes: int | None = DEFAULT_MAX_BYTES
) -> tuple[TraceHeader, list[TraceEntry]]:
    """Read a trace file (a truncated last record is ignored).

    Args:
        path: A file written by :class:`TraceRecorder`.
        max_bytes: The most bytes of synthetic operands a replay of this trace may allocate,
            summed over every distinct operand set of every transfer call, whatever its
            recorded outcome (:data:`DEFAULT_MAX_BYTES`; ``None`` lifts the cap).

    Raises:
        InvalidFileError: not a kvactors trace of this format, a malformed record, or operands
            above ``max_bytes`` (a ValueError).
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
            f"{path}: trace format {header.format!r}, expected {_FORMAT!r} (record it again: "
            "format 1 held process-local stream handles)",
            path=path,
        )
    dec = msgspec.msgpack.Decoder(TraceEntry)
    entries: list[TraceEntry] = []
    streams = 0
    for i, r in enumerate(recs[1:], start=1):
        try:
            e = dec.decode(r)
        except msgspec.DecodeError as exc:
            raise InvalidFileError(f"{path}: record {i} is malformed ({exc})", path=path) from exc
        if e.kind == "call":
            _check_call(path, i, e)
        if e.kind == "call" and e.stream_handle > streams:
            # Identities are numbered in order of first use: a new one is the next number.
            if e.stream_handle != streams + 1:
                raise InvalidFileError(
                    f"{path}: record {i} uses stream {e.stream_handle} before stream "
                    f"{streams + 1} (stream identities count up from 1 in order of first use)",
                    path=path,
                )
            streams += 1
        entries.append(e)
    ok = {e.seq for e in entries if e.kind == "done" and not e.error}
    for i, e in enumerate(entries, start=1):
        if e.kind == "call" and e.seq in ok:
            _check_sizes(path, i, e)
    _check_total(path, entries, max_bytes)
    return header, entries


_MESSAGE = {"transfer": Transfer, "fence": Fence, "ping": Ping}
_SLACK = 4  # synthetic operands may exceed what the request describes by this factor at most


def _check_call(path: str, i: int, e: TraceEntry) -> None:
    """A ``call`` entry replay can act on: its op, message type, operand shapes and dtype."""

    def bad(what: str) -> InvalidFileError:
        return InvalidFileError(f"{path}: record {i} ({e.op}): {what}", path=path)

    if e.op not in _RECORDED:
        raise bad("not a recorded operation")
    if e.stream_handle < 0:
        raise bad(f"stream {e.stream_handle}")
    want = _MESSAGE.get(e.op)
    if want is None:  # synchronize: the stream is the whole message
        return
    try:
        msg = GATHER_REQUESTS.decode(e.message)
    except msgspec.DecodeError as exc:
        raise bad(f"undecodable message ({exc})") from exc
    if not isinstance(msg, want):
        raise bad(f"holds a {type(msg).__name__} message")
    if not isinstance(msg, Transfer):
        return
    if msg.stream_handle != e.stream_handle:
        raise bad(f"message stream {msg.stream_handle} is not the entry's {e.stream_handle}")
    ops = e.operands
    if ops is None:
        return  # recorded without shapes: an operand the runtime refused; replay refuses it too
    if not isinstance(getattr(torch, ops.dtype, None), torch.dtype):
        raise bad(f"dtype {ops.dtype!r} is not a torch dtype")
    if not ops.paged or (ops.paged_kind == "tensor" and len(ops.paged) != 1):
        raise bad(f"{len(ops.paged)} paged tensors for kind {ops.paged_kind!r}")
    shapes = [*ops.paged, *ops.objects]
    if any(d < 0 for shape in shapes for d in shape):
        raise bad("a negative dimension")


def _check_sizes(path: str, i: int, e: TraceEntry) -> None:
    """The operands of a call recorded as ok fit its request.

    Replay allocates them (the paged ones on the device): never far more than the request
    describes. A call recorded as failed may have had any operands (that can be why it failed)
    and is replayed as recorded. The request is the file's own word, so this is no bound on
    memory: :func:`_check_total`'s cap is, for every call.
    """
    if e.op != "transfer" or e.operands is None:
        return
    if e.operands.paged_kind == "kv_list" and len(e.operands.paged) % 2:
        raise InvalidFileError(
            f"{path}: record {i} (transfer): a K/V list of an odd number of tensors", path=path
        )
    msg = GATHER_REQUESTS.decode(e.message)
    assert isinstance(msg, Transfer)  # checked by _check_call
    sd, req = msg.request.shape, msg.request
    block = max(sd.bs * sd.nh * sd.hs, sd.block_stride_elems)  # elements of one block
    pool = sd.kv_size * sd.nl * sd.nb * block
    tokens = len(req.block_ids) * sd.bs + req.chunk_size  # the chunks' tokens, a partial one too
    moved = sd.kv_size * sd.nl * tokens * sd.nh * sd.hs
    paged = sum(math.prod(shape) for shape in e.operands.paged)
    objects = sum(math.prod(shape) for shape in e.operands.objects)
    if paged > _SLACK * max(pool, 1) or objects > _SLACK * max(moved, 1):
        raise InvalidFileError(
            f"{path}: record {i} (transfer): operands of {paged} + {objects} elements for a "
            f"request that describes {pool} paged and about {moved} chunk elements",
            path=path,
        )


def _check_total(path: str, entries: list[TraceEntry], max_bytes: int | None) -> None:
    """The operands replay would allocate, over all calls, fit ``max_bytes``.

    Every transfer call counts, recorded as ok, as failed or with no outcome at all, and so do
    the sizes the file declares for its requests: only the cap, which the file does not
    control, bounds what a replay allocates. Replay keeps one paged set and one chunk set per
    distinct signature (:class:`_Operands`), so the total is over distinct signatures.
    """
    if max_bytes is None:
        return
    seen: set[bytes] = set()
    total = 0
    for i, e in enumerate(entries, start=1):
        if e.kind != "call" or e.operands is None:
            continue
        itemsize = getattr(torch, e.operands.dtype).itemsize  # a dtype: checked by _check_call
        for key, shapes in zip(
            _operand_keys(e.operands), (e.operands.paged, e.operands.objects), strict=True
        ):
            if key not in seen:
                seen.add(key)
                total += itemsize * sum(math.prod(shape) for shape in shapes)
        if total > max_bytes:
            raise InvalidFileError(
                f"{path}: record {i} ({e.op}, seq {e.seq}): replaying this trace would "
                f"allocate {total} bytes of synthetic operands by this record, above the cap "
                f"of {max_bytes} bytes (kvactors replay --max-bytes lifts it; trust the file "
                "first: a trace holds no data, only the shapes it declares)",
                path=path,
            )


def replay_backend(header: TraceHeader, kind: str, default: Backend | None = None) -> Backend:
    """A backend of ``kind`` with the settings ``header`` recorded (see :data:`BACKEND_SETTINGS`).

    A recorded setting wins over the replaying environment (on MLU, over
    ``KVACTORS_MLU_LAYOUT_SOURCE``), and one recorded as unset stays unset, so a transfer is
    accepted or refused as it was when recorded.

    Args:
        header: The trace's header.
        kind: The device kind to replay on.
        default: The backend to use when the trace was recorded on another kind or holds no
            settings for this one (default: ``get_backend(kind)``).

    Raises:
        InvalidFileError: a recorded setting this kvactors does not accept (a ValueError).
    """
    if header.device != kind or kind != "mlu" or "layout_source" not in header.settings:
        return default if default is not None else get_backend(kind)
    from kvactors.devices.mlu import MluBackend
    from kvactors.devices.mlu.layouts import LAYOUT_SOURCE_ENV

    recorded = header.settings["layout_source"]
    if recorded not in _LAYOUT_SOURCES:
        raise InvalidFileError(f"the trace records layout_source {recorded!r}", path="")
    env = {k: v for k, v in os.environ.items() if k != LAYOUT_SOURCE_ENV}
    return MluBackend(layout_source=_LAYOUT_SOURCES[recorded], env=env)


_LAYOUT_SOURCES: Mapping[str, LayoutSource | None] = {
    "": None,
    "legacy": "legacy",
    "resolved": "resolved",
}


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
        dtype = getattr(torch, s.dtype)
        pkey, okey = _operand_keys(s)
        if pkey not in self.cache:
            tensors = [self._dev(shape, dtype) for shape in s.paged]
            paged: Any
            if s.paged_kind == "tensor":
                paged = tensors[0]
            elif s.paged_kind == "kv_list":
                half = len(tensors) // 2
                paged = [tensors[:half], tensors[half:]]
            else:
                paged = tensors
            self.cache[pkey] = paged
        if okey not in self.cache:
            self.cache[okey] = [torch.zeros(shape, dtype=dtype) for shape in s.objects]
        objects: list[torch.Tensor] = self.cache[okey]
        return self.cache[pkey], objects


def _operand_keys(s: OperandShapes) -> tuple[bytes, bytes]:
    """The cache keys of a call's paged memory and of its chunks: replay makes one paged set
    per distinct paged signature and one chunk set per distinct chunk signature."""
    paged = msgspec.msgpack.encode(("paged", s.paged_kind, s.paged, s.dtype))
    return paged, msgspec.msgpack.encode(("objects", s.objects, s.dtype))


async def _replay(
    rt: Runtime, entries: list[TraceEntry], env: DeviceMemory | None, report: ReplayReport
) -> None:
    calls = [e for e in entries if e.kind == "call"]
    done = {e.seq: e for e in entries if e.kind == "done"}
    operands = _Operands(env)
    tasks: dict[int, asyncio.Task[None]] = {}
    own: dict[int, StreamLike] = {}  # trace identity -> a stream this replay made

    def handle(ident: int) -> int:
        # 0 is the default stream; any other identity a stream of this process, made on first
        # use and kept until the replay ends (never a handle read from the file).
        if ident == 0:
            return 0
        if ident not in own:
            own[ident] = rt.backend.new_stream(rt.device_index)
        return rt.backend.stream_handle(own[ident])

    def submit(e: TraceEntry) -> asyncio.Future[Any]:
        # Called in trace order: the a* methods queue their message when called, so the
        # mailbox order of the replay is the trace order (a recorded fence after a store is
        # queued after it). Only the waiting happens in a task.
        if e.op == "transfer":
            msg = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg, Transfer)
            # No shapes: operands the recording could not describe, which the runtime refused;
            # no operands here, which it refuses too.
            paged, objects = operands.get(e.operands) if e.operands is not None else (None, [])
            return asyncio.ensure_future(
                rt.atransfer(msg.request, paged, objects, stream_handle=handle(e.stream_handle))
            )
        if e.op == "fence":
            msg_f = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg_f, Fence)
            return asyncio.ensure_future(rt.afence(msg_f.block_ids))
        if e.op == "ping":
            msg_p = GATHER_REQUESTS.decode(e.message)
            assert isinstance(msg_p, Ping)
            return asyncio.ensure_future(rt.aping(msg_p.seq))
        return asyncio.get_running_loop().run_in_executor(
            None, rt.synchronize, handle(e.stream_handle)
        )

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


def replay(
    path: str,
    rt: Runtime,
    *,
    env: DeviceMemory | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> ReplayReport:
    """Replay the trace at ``path`` on ``rt`` (started if needed); see the module docstring.

    Args:
        path: A file written by :class:`TraceRecorder`.
        rt: A fresh runtime (its device decides where synthetic paged memory lives; build its
            backend with :func:`replay_backend` to apply the recorded settings).
        env: How to allocate device memory (default: host tensors, for the ``cpu`` backend).
        max_bytes: The cap on the synthetic operands allocated, all calls together (see
            :func:`read_trace`; ``None`` lifts it). Checked before anything is allocated.

    Raises:
        InvalidFileError: the file is not a readable trace, or its operands exceed
            ``max_bytes`` (a ValueError).
    """
    _, entries = read_trace(path, max_bytes=max_bytes)
    rt.start()
    report = ReplayReport()
    if entries:
        report.recorded_seconds = max(e.t for e in entries)
    t0 = time.perf_counter()
    asyncio.run(_replay(rt, entries, env, report))
    report.seconds = time.perf_counter() - t0
    return report


def iter_messages(path: str) -> Iterator[tuple[float, msgspec.Struct]]:
    """``(t, message)`` of every recorded call that is a GatherActor message, in order.

    Nothing is allocated from the operand shapes, so no operand cap applies.
    """
    _, entries = read_trace(path, max_bytes=None)
    for e in entries:
        if e.kind == "call" and e.op != "synchronize":
            yield e.t, GATHER_REQUESTS.decode(e.message)
