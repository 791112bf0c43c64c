"""kvactors selftest / kvactors.testing.check_backend: passes on cpu and the fakes, refuses a
missing runtime, and each rule check FAILS when its rule is broken.

The broken backends below each remove one rule (a fake fault knob, or a backend subclass
with one verb wrong); the suite runs them through the Runtime, as it runs the real ones. A
broken rule shows as stale bytes on the fake's asynchronous streams, so those runs are
repeated a bounded number of times and must fail at least once; the correct backends must
pass every time.
"""

from __future__ import annotations

import importlib.util
import json
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvactors.cli import main
from kvactors.devices.mlu import MluBackend
from kvactors.devices.musa import MusaBackend
from kvactors.testing import BackendReport, check_backend

if TYPE_CHECKING:
    from pathlib import Path

KINDS = ("mlu", "musa")
BACKENDS: dict[str, type[MluBackend] | type[MusaBackend]] = {"mlu": MluBackend, "musa": MusaBackend}
ORDERING = ("order.publish_after_sync", "order.handle0_default_stream", "order.borrowed_stream")
ATTEMPTS = 4


def _backend(kind: str) -> MluBackend | MusaBackend:
    """The suite allocates real NHD memory: on MLU, format 1 is declared resolved."""
    return MluBackend(layout_source="resolved") if kind == "mlu" else MusaBackend()


def _check(report: BackendReport, name: str) -> Any:
    (found,) = [c for c in report.checks if c.name == name]
    return found


# ---- the command --------------------------------------------------------------------------


def test_cpu_passes_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "report.json"
    assert main(["selftest", "--device", "cpu", "--json", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" not in text
    assert text.strip().splitlines()[-1].startswith("PASS: ")
    data = json.loads(out_file.read_text())
    assert data["device"] == "cpu:0"
    assert data["simulated"] is False
    assert data["ok"] is True
    assert {"kvactors", "torch", "python"} <= set(data["versions"])
    by_name = {c["name"]: c for c in data["checks"]}
    assert set(next(iter(by_name.values()))) >= {"name", "ok", "detail", "seconds", "skipped"}
    for name in (
        "probe",
        "roundtrip.NL_X_TWO_NB_BS_NH_HS.d2h.skip1",
        "roundtrip.TWO_X_NL_X_NB_BS_NH_HS.h2d.skip0",
        "strided_d2h",
        "ipc.close_after_sync",
        "throughput",
    ):
        assert by_name[name]["ok"] is True
        assert by_name[name]["skipped"] is False, name
    assert "across processes" in by_name["ipc.close_after_sync"]["detail"]
    for name in ORDERING:  # no asynchronous streams on cpu: said, not faked
        assert by_name[name]["skipped"] is True
    assert by_name["throughput"]["metrics"]["d2h_gbps"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_fake_passes_and_says_simulated(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "report.json"
    assert main(["selftest", "--device", kind, "--fake", "--json", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text.splitlines()[0]
    assert text.strip().splitlines()[-1].startswith("PASS (SIMULATED): ")
    data = json.loads(out_file.read_text())
    assert data["simulated"] is True
    assert data["device"] == f"{kind}:0"
    assert data["ok"] is True
    skipped = {c["name"] for c in data["checks"] if c["skipped"]}
    assert not skipped & {*ORDERING, "strided_d2h", "throughput"}
    # MUSA has memory IPC; the MLU backend refuses IPC (a skip that says why).
    assert ("ipc.close_after_sync" in skipped) is (kind == "mlu")


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            k,
            marks=pytest.mark.skipif(
                importlib.util.find_spec(f"torch_{k}") is not None,
                reason=f"torch_{k} is installed here",
            ),
        )
        for k in KINDS
    ],
)
def test_missing_runtime_fails_and_names_it(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "report.json"
    assert main(["selftest", "--device", kind, "--json", str(out_file)]) == 1
    text = capsys.readouterr().out
    assert f"torch_{kind} is not importable" in text
    assert "--fake" in text
    data = json.loads(out_file.read_text())
    assert data["ok"] is False
    assert [c["name"] for c in data["checks"]] == ["probe"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--device", "cuda"]) == 1
    assert "CUDA is not available" in capsys.readouterr().out


def test_fake_needs_a_fakeable_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--device", "cpu", "--fake"]) == 2
    assert "--fake simulates mlu and musa only" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no fake cuda"):
        check_backend("cuda", fake=True)
    with pytest.raises(ValueError, match="unknown check groups"):
        check_backend("cpu", only=["nope"])


def test_report_is_frozen() -> None:
    report = check_backend("cpu", only=["strided_d2h"])
    assert [c.name for c in report.checks] == ["probe", "strided_d2h"]
    with pytest.raises(AttributeError):
        report.checks = ()  # type: ignore[misc]
    assert report.ok


# ---- each check fails when its rule is broken ---------------------------------------------


class _NeverWaits:
    """A marker that claims completion at once, whatever its stream still runs."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _broken(kind: str, verb: str) -> Any:
    base = BACKENDS[kind]

    class Broken(base):  # type: ignore[valid-type,misc]
        def stream_from_handle(self, handle: int, index: int) -> Any:
            if verb == "handle0" and handle == 0:
                return self.module.ExternalStream(0, device=index)  # a pool stream
            if verb == "borrow" and handle != 0:
                return self.module.Stream(device=index)  # not the caller's stream
            return super().stream_from_handle(handle, index)

        def synchronize(self, stream: object) -> None:
            if verb != "sync":
                super().synchronize(stream)

        def record_marker(self, stream: object) -> Any:
            # A record on a stream waits on a marker recorded there: "sync" breaks that wait too.
            return super().record_marker(stream) if verb != "sync" else _NeverWaits()

    # The suite allocates real NHD memory: on MLU, format 1 is declared resolved.
    return Broken(layout_source="resolved") if kind == "mlu" else Broken()


def _fails(make: Any, name: str, **kw: Any) -> bool:
    return any(
        not _check(check_backend(make(), only=[name], **kw), name).ok for _ in range(ATTEMPTS)
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("name", "verb"),
    [
        ("order.publish_after_sync", "sync"),
        ("order.handle0_default_stream", "handle0"),
        ("order.borrowed_stream", "borrow"),
    ],
)
def test_ordering_check_fails_when_rule_broken(kind: str, name: str, verb: str) -> None:
    good = _check(check_backend(_backend(kind), fake=True, only=[name]), name)
    assert good.ok
    assert not good.skipped
    assert _fails(lambda: _broken(kind, verb), name, fake=True)


def test_ipc_close_check_fails_without_stream_sync() -> None:
    name = "ipc.close_after_sync"
    good = _check(check_backend(MusaBackend(), fake=True, only=[name]), name)
    assert good.ok
    assert not good.skipped
    assert _fails(lambda: _broken("musa", "sync"), name, fake=True)


@pytest.mark.parametrize("kind", KINDS)
def test_strided_d2h_check_fails_without_blocking_policy(kind: str) -> None:
    knobs = {"strided_d2h_bug": True}
    extra: dict[str, Any] = {"layout_source": "resolved"} if kind == "mlu" else {}
    good = check_backend(BACKENDS[kind](**extra), fake=knobs, only=["strided_d2h", "roundtrip"])
    assert good.ok, good.failed
    assert not _check(good, "strided_d2h").skipped
    bad = check_backend(
        BACKENDS[kind](blocking_strided_d2h=False, **extra),
        fake=knobs,
        only=["strided_d2h", "roundtrip"],
    )
    assert not _check(bad, "strided_d2h").ok
    failed = {c.name for c in bad.failed}
    assert "roundtrip.NL_X_TWO_NB_BS_NH_HS.d2h.skip1" in failed
    assert not any(".h2d." in n for n in failed)  # the bug is D2H only
