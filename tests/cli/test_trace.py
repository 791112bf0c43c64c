"""Trace record and replay: messages recorded from outside, replayed on a fresh runtime."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.cli import main
from kvactors.cli.demo import DemoConfig, run_demo
from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.core.protocols.gather import Fence, Transfer
from kvactors.observe.trace import TraceRecorder, iter_messages, read_trace, replay
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    import pathlib

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
