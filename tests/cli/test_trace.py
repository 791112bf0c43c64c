"""Trace record and replay: messages recorded from outside, replayed on a fresh runtime."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import msgspec
import pytest
import torch

from kvactors.cli import main
from kvactors.cli.demo import DemoConfig, run_demo
from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.core.protocols.gather import Fence, Transfer
from kvactors.errors import InvalidFileError, TransferValidationError
from kvactors.observe.trace import (
    TraceEntry,
    TraceHeader,
    TraceRecorder,
    iter_messages,
    read_trace,
    replay,
    replay_backend,
)
from kvactors.runtime import Runtime

SHAPE = ShapeDesc(kv_size=2, nl=2, nb=8, bs=4, nh=2, hs=8, element_size=2, dtype="bfloat16")


def _req(direction: int, ids: tuple[int, ...]) -> TransferRequest:
    return TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=direction,
        block_ids=ids,
        chunk_size=8,
        shape=SHAPE,
    )


def _record(path: pathlib.Path) -> int:
    paged = [torch.ones(2, 8, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    objs = [torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16) for _ in range(2)]
    moved = 0
    with Runtime("cpu") as rt, TraceRecorder(str(path), device="cpu").attach(rt):
        moved += rt.transfer(_req(1, (3, 1, 6, 0)), paged, objs).nbytes
        rt.fence([3, 1])
        moved += rt.transfer(_req(0, (2, 5, 7, 4)), paged, objs).nbytes
        rt.synchronize()
        rt.ping(7)
        with pytest.raises(ValueError, match="99"):
            rt.transfer(_req(1, (3, 1, 6, 99)), paged, objs)  # block 99 is out of range
    return moved


def test_round_trip(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.trace"
    moved = _record(path)
    header, entries = read_trace(str(path))
    assert header.device == "cpu"
    calls = [e for e in entries if e.kind == "call"]
    assert [e.op for e in calls] == [
        "transfer",
        "fence",
        "transfer",
        "synchronize",
        "ping",
        "transfer",
    ]
    assert [e.seq for e in calls] == sorted(e.seq for e in calls)
    msgs = [m for _, m in iter_messages(str(path))]
    assert isinstance(msgs[0], Transfer)
    assert msgs[0].request == _req(1, (3, 1, 6, 0))
    assert msgs[1] == Fence(block_ids=(3, 1))
    with Runtime("cpu") as fresh:
        report = replay(str(path), fresh)
        stats = fresh.statistics()
    assert report.ok, report.outcome_mismatches
    assert report.calls == 6
    assert report.transfers == 2
    assert report.bytes_moved == moved == stats.bytes_moved


def test_truncated_trace_keeps_its_prefix(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.trace"
    _record(path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    _, entries = read_trace(str(path))
    assert 0 < len(entries) < 12
    (tmp_path / "junk").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="not a kvactors trace"):
        read_trace(str(tmp_path / "junk"))


def test_demo_trace_replays_through_the_cli(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.trace"
    assert main(["demo", "--requests", "25", "--trace", str(path)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert data["transfers"] > 0


def test_recording_patches_nothing_and_detaches(tmp_path: pathlib.Path) -> None:
    with Runtime("cpu") as rt:
        rec = TraceRecorder(str(tmp_path / "x"), device="cpu").attach(rt)
        assert "transfer" not in vars(rt)  # the runtime reports calls itself
        rt.ping()
        seen = rec.entries
        assert seen == 3  # header, call, done
        rec.close()
        rt.ping()
        assert rec.entries == seen
    assert run_demo(DemoConfig(requests=5)).ok


ROOT = pathlib.Path(__file__).resolve().parents[2]

# Process A: a fake-MLU runtime serving a caller's borrowed stream, recorded to a trace.
_RECORD_BORROWED = r"""
import json, sys, torch
from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices.mlu import MluBackend
from kvactors.observe.trace import TraceRecorder
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor

torch.set_num_threads(1)
shape = ShapeDesc(kv_size=2, nl=2, nb=8, bs=4, nh=2, hs=8, element_size=4, dtype="float32")
def req(d, ids):
    return TransferRequest(fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS), direction=d,
                           block_ids=ids, chunk_size=8, shape=shape)
with fake_vendor("mlu") as fake:
    paged = [fake.to_device(torch.ones(2, 8, 4, 2, 8)) for _ in range(2)]
    objs = [torch.zeros(2, 2, 8, 16)]
    with Runtime(MluBackend(layout_source="resolved")) as rt:
        rec = TraceRecorder(sys.argv[1]).attach(rt)
        s1, s2 = torch.mlu.Stream(), torch.mlu.Stream()
        handles = [s1.mlu_stream, s2.mlu_stream]
        rt.transfer(req(0, (1, 2)), paged, objs, stream_handle=handles[1])
        rt.transfer(req(1, (3, 4)), paged, objs, stream_handle=handles[0])
        rt.transfer(req(0, (5, 6)), paged, objs)
        rt.synchronize(handles[1])
        rt.synchronize(handles[0])
        rec.close()
print(json.dumps(handles))
"""

# Process B: replays it on the fake MLU and lists the handles its backend was asked to wrap.
_REPLAY = r"""
import json, sys, torch
from kvactors.cli._devenv import device_env
from kvactors.observe.trace import read_trace, replay, replay_backend
from kvactors.runtime import Runtime

torch.set_num_threads(1)
wrapped = []
with device_env("mlu") as env:
    real = torch.mlu.ExternalStream
    class Logged(real):
        def __new__(cls, ptr, device=None, **kw):
            wrapped.append(ptr)
            return real.__new__(real, ptr, device, **kw)
    torch.mlu.ExternalStream = Logged
    header, _ = read_trace(sys.argv[1])
    with Runtime(replay_backend(header, "mlu")) as rt:
        report = replay(sys.argv[1], rt, env=env)
    torch.mlu.ExternalStream = real
print(json.dumps({"ok": report.ok, "mismatches": report.outcome_mismatches,
                  "transfers": report.transfers, "wrapped": wrapped}))
"""


def _python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVACTORS_MLU_LAYOUT_SOURCE", None)
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_borrowed_streams_cross_processes_as_identities_never_as_pointers(
    tmp_path: pathlib.Path,
) -> None:
    path = str(tmp_path / "borrowed.trace")
    handles = json.loads(_python(_RECORD_BORROWED, path))
    header, entries = read_trace(path)
    assert header.settings == {"layout_source": "resolved"}
    calls = [e for e in entries if e.kind == "call"]
    # Order of first use: the second stream was used first, so it is 1; the default stays 0.
    assert [(e.op, e.stream_handle) for e in calls] == [
        ("transfer", 1),
        ("transfer", 2),
        ("transfer", 0),
        ("synchronize", 1),
        ("synchronize", 2),
    ]
    msgs = [m for _, m in iter_messages(path)]
    assert [m.stream_handle for m in msgs if isinstance(m, Transfer)] == [1, 2, 0]
    data = (tmp_path / "borrowed.trace").read_bytes()
    for h in handles:  # msgpack writes these pointers as uint64: not a byte of them is there
        assert h.to_bytes(8, "big") not in data
    out = json.loads(_python(_REPLAY, path))
    assert out["ok"], out["mismatches"]
    assert out["transfers"] == 3
    assert len(set(out["wrapped"])) == 2  # two streams of its own, one per identity
    assert not set(out["wrapped"]) & set(handles)


def test_stream_identities_out_of_order_are_refused(tmp_path: pathlib.Path) -> None:
    def rec(x: msgspec.Struct) -> bytes:
        b = msgspec.msgpack.encode(x)
        return len(b).to_bytes(4, "little") + b

    sync = TraceEntry(kind="call", seq=1, t=0.0, op="synchronize", stream_handle=0x7F0000000080)
    path = tmp_path / "ptr.trace"
    path.write_bytes(rec(TraceHeader(device="mlu", created=0.0)) + rec(sync))
    with pytest.raises(ValueError, match="order of first use"):
        read_trace(str(path))
    assert main(["replay", str(path)]) == 2


def test_format_1_traces_are_refused(tmp_path: pathlib.Path) -> None:
    b = msgspec.msgpack.encode(TraceHeader(format="kvactors-trace/1", device="cpu", created=0.0))
    path = tmp_path / "v1.trace"
    path.write_bytes(len(b).to_bytes(4, "little") + b)
    with pytest.raises(ValueError, match="process-local stream handles"):
        read_trace(str(path))


@pytest.mark.parametrize("device", ["mlu", "musa"])
def test_demo_trace_replays_on_the_fake_vendor(
    device: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "demo.trace")
    assert main(["demo", "--device", device, "--requests", "12", "--trace", path]) == 0
    capsys.readouterr()
    header, _ = read_trace(path)
    assert header.device == device
    assert header.settings == ({"layout_source": "resolved"} if device == "mlu" else {})
    assert main(["replay", path, "--device", device, "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])
    assert data["ok"] is True, data["outcome_mismatches"]
    assert data["transfers"] > 0


def test_replay_applies_the_recorded_layout_source_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvactors.devices.mlu import MluBackend

    monkeypatch.setenv("KVACTORS_MLU_LAYOUT_SOURCE", "legacy")
    resolved = TraceHeader(device="mlu", created=0.0, settings={"layout_source": "resolved"})
    backend = replay_backend(resolved, "mlu")
    assert isinstance(backend, MluBackend)
    assert backend.layout_source == "resolved"
    unset = replay_backend(
        TraceHeader(device="mlu", created=0.0, settings={"layout_source": ""}), "mlu"
    )
    assert isinstance(unset, MluBackend)
    assert unset.layout_source is None  # ambiguous when recorded: ambiguous when replayed
    unknown = replay_backend(TraceHeader(device="mlu", created=0.0), "mlu")  # not attached
    assert isinstance(unknown, MluBackend)
    assert unknown.layout_source == "legacy"  # nothing recorded: the environment decides
    with pytest.raises(ValueError, match="layout_source"):
        replay_backend(
            TraceHeader(device="mlu", created=0.0, settings={"layout_source": "x"}), "mlu"
        )


def _inflate(path: pathlib.Path, factor: int) -> None:
    """Rewrite the trace with every transfer's paged operand shapes ``factor`` times larger."""
    header, entries = read_trace(str(path))
    out = []
    for e in [header, *entries]:
        if isinstance(e, TraceEntry) and e.operands is not None:
            paged = [[s[0] * factor, *s[1:]] for s in e.operands.paged]
            e = msgspec.structs.replace(
                e, operands=msgspec.structs.replace(e.operands, paged=paged)
            )
        b = msgspec.msgpack.encode(e)
        out.append(len(b).to_bytes(4, "little") + b)
    path.write_bytes(b"".join(out))


def test_damaged_operand_sizes_are_refused_before_allocating(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.trace"
    _record(path)
    _inflate(path, 2)  # within the slack: replayed (and refused by the runtime, as a mismatch)
    read_trace(str(path))
    _inflate(path, 1000)  # 2000 times the pool the requests describe
    with pytest.raises(ValueError, match="elements for a request that describes"):
        read_trace(str(path))
    assert main(["replay", str(path)]) == 2


def test_a_recorded_refusal_of_mismatched_operands_replays_as_recorded(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "t.trace"
    big = [torch.ones(2, 80, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]  # nb 80, not 8
    objs = [torch.zeros(2, 2, 8, 16, dtype=torch.bfloat16) for _ in range(2)]
    with (
        Runtime("cpu") as rt,
        TraceRecorder(str(path)).attach(rt),
        pytest.raises(TransferValidationError),
    ):
        rt.transfer(_req(1, (3, 1, 6, 0)), big, objs)
    with Runtime("cpu") as fresh:
        report = replay(str(path), fresh)
    assert report.ok, report.outcome_mismatches
    assert report.calls == 1


def test_bit_flipped_traces_end_in_a_clean_exit(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A seeded loop of byte mutations and truncations of a real trace: replay answers 0, 1 or
    # 2 (a clean "bad input" message), never a traceback.
    path = tmp_path / "t.trace"
    _record(path)
    data = path.read_bytes()
    rng = random.Random(29)
    codes = []
    for i in range(40):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if i % 4 == 3:
            b = b[: rng.randrange(len(b))]
        (tmp_path / "f").write_bytes(bytes(b))
        codes.append(main(["replay", str(tmp_path / "f")]))
    assert set(codes) <= {0, 1, 2}
    assert 2 in codes
    assert "Traceback" not in capsys.readouterr().err


def _rec(x: msgspec.Struct) -> bytes:
    b = msgspec.msgpack.encode(x)
    return len(b).to_bytes(4, "little") + b


def _one_call_trace(path: pathlib.Path, objects: list[list[int]], outcome: str | None) -> None:
    """A hand-written trace: one store whose chunk shapes are ``objects``; ``outcome`` is the
    recorded error (``""`` for ok, ``None`` for no done entry at all)."""
    from kvactors.core.protocols.codec import encode
    from kvactors.observe.trace import OperandShapes

    ops = OperandShapes(
        paged_kind="list", paged=[[2, 8, 4, 2, 8]] * 2, objects=objects, dtype="bfloat16"
    )
    msg = encode(Transfer(transfer_id=1, request=_req(1, (3, 1, 6, 0)), stream_handle=0))
    data = _rec(TraceHeader(device="cpu", created=0.0))
    data += _rec(TraceEntry(kind="call", seq=1, t=0.0, op="transfer", message=msg, operands=ops))
    if outcome is not None:
        data += _rec(TraceEntry(kind="done", seq=1, t=0.001, op="transfer", error=outcome))
    path.write_bytes(data)


_STATUSES = {"ok": "", "failed": "TransferValidationError", "no-outcome": None}


@pytest.mark.parametrize("status", sorted(_STATUSES))
def test_the_operand_cap_holds_whatever_the_recorded_outcome(
    status: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The 2 paged tensors are 4,096 bytes, the chunk (within the slack of its request) 3,072.
    path = tmp_path / "t.trace"
    _one_call_trace(path, [[2, 2, 8, 48]], _STATUSES[status])
    with pytest.raises(InvalidFileError, match=r"allocate 7168 bytes .* cap of 4096 bytes"):
        read_trace(str(path), max_bytes=4096)
    assert main(["replay", str(path), "--max-bytes", "4096"]) == 2
    err = capsys.readouterr().err
    assert "record 1 (transfer, seq 1)" in err
    assert "--max-bytes" in err
    # At the total exactly, or with the cap lifted (0), the same file replays; the oversized
    # chunk is refused by the runtime, which matches only the call recorded as failed.
    read_trace(str(path), max_bytes=7168)
    assert main(["replay", str(path), "--max-bytes", "0"]) == (0 if status == "failed" else 1)


def test_the_default_cap_refuses_a_declared_gigabyte_before_any_runtime(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A few hundred bytes declaring a 1 GiB chunk: refused by read_trace, and the command never
    # builds a runtime (nor allocates the operands it would have made).
    from kvactors.cli import replay as replay_cli
    from kvactors.observe.trace import DEFAULT_MAX_BYTES

    path = tmp_path / "t.trace"
    _one_call_trace(path, [[2**29]], None)
    assert path.stat().st_size < 1024
    with pytest.raises(InvalidFileError, match=f"cap of {DEFAULT_MAX_BYTES} bytes") as info:
        read_trace(str(path))
    assert info.value.path == str(path)
    # Reading the messages allocates nothing from the shapes: no cap there.
    assert [type(m) for _, m in iter_messages(str(path))] == [Transfer]

    def no_runtime(*a: object, **k: object) -> None:
        raise AssertionError("a runtime was built for a refused trace")

    monkeypatch.setattr(replay_cli, "Runtime", no_runtime)
    assert main(["replay", str(path)]) == 2
    with pytest.raises(SystemExit):
        main(["replay", str(path), "--max-bytes", "-1"])
    # ``run`` called with the command's earlier arguments (no max_bytes): the default cap.
    import argparse

    assert replay_cli.run(argparse.Namespace(trace=str(path), device="cpu", json=False)) == 2


def test_the_operand_cap_is_over_every_distinct_operand_set(tmp_path: pathlib.Path) -> None:
    # Replay keeps one operand set per distinct shape signature: a repeated signature counts
    # once, two signatures count twice.
    from kvactors.core.protocols.codec import encode
    from kvactors.observe.trace import OperandShapes

    def call(seq: int, width: int) -> TraceEntry:
        ops = OperandShapes(
            paged_kind="list", paged=[[2, 8, 4, 2, 8]] * 2, objects=[[width]], dtype="bfloat16"
        )
        msg = encode(Transfer(transfer_id=seq, request=_req(1, (3, 1)), stream_handle=0))
        return TraceEntry(kind="call", seq=seq, t=0.0, op="transfer", message=msg, operands=ops)

    head = _rec(TraceHeader(device="cpu", created=0.0))
    same, other = tmp_path / "same.trace", tmp_path / "other.trace"
    same.write_bytes(head + _rec(call(1, 2048)) + _rec(call(2, 2048)))
    other.write_bytes(head + _rec(call(1, 2048)) + _rec(call(2, 2049)))
    read_trace(str(same), max_bytes=4096 + 4096)  # one set: 4,096 paged + 4,096 chunk bytes
    with pytest.raises(InvalidFileError, match=r"record 2 .* allocate 12290 bytes"):
        read_trace(str(other), max_bytes=4096 + 4096)
