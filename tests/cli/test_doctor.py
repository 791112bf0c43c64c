"""kvactors doctor: the report, JSON output, and the predicted LMCache selection."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from kvactors.cli import main
from kvactors.cli._selection import SpecFact, predict_selection
from kvactors.cli.doctor import ENV_VARS, collect

_ENV = (*ENV_VARS, "KVACTORS_LMCACHE_CPU")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for needle in ("backends:", "cpu   available", "LMCache selection (predicted)", "findings:"):
        assert needle in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert {b["backend"] for b in data["backends"]} == {"cpu", "mlu", "musa", "cuda"}
    assert data["selection"]["outcome"] in ("selected", "stub")
    assert "torch" in data["packages"]


def test_doctor_flags_unavailable_explicit_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "kvactors_musa")
    rc = main(["doctor"])
    out = capsys.readouterr().out
    if collect().packages["torch_musa"] is None:
        assert rc == 1
        assert "[FAIL]" in out
        assert "LMCACHE_DEVICE_BACKEND='kvactors_musa' is registered but not available" in out
    assert "LMCACHE_DEVICE_BACKEND=kvactors_musa" in out  # listed among the environment


def test_doctor_sees_fake_mlu(fake_mlu: object) -> None:
    report = collect({})
    mlu = next(p for p in report.backends if p.backend == "mlu")
    assert mlu.available
    if "mlu" in report.plugins:
        assert report.selection.backend == "mlu"
        assert report.selection.kvactors
        assert report.selection.transfer_mode == "engine_driven"


def _specs(**avail: bool) -> list[SpecFact]:
    base: list[tuple[str, str, Literal["builtin", "plugin"]]] = [
        ("cpu", "cpu", "builtin"), ("cuda", "cuda", "builtin"), ("musa", "musa", "builtin"),
        ("kvactors_cpu", "cpu", "plugin"), ("kvactors_musa", "musa", "plugin"),
        ("mlu", "mlu", "plugin"),
    ]
    order = ["cpu", "cuda", "musa"]
    facts = [SpecFact(backend=n, device_type=t, origin=o, available=avail.get(n, False))
             for n, t, o in base]
    return sorted(facts, key=lambda f: order.index(f.device_type) if f.device_type in order
                  else len(order))


def test_selection_nothing_available_is_the_stub() -> None:
    s = predict_selection(_specs(), {})
    assert s.outcome == "stub"
    assert not s.kvactors


def test_selection_mlu_auto() -> None:
    s = predict_selection(_specs(mlu=True), {})
    assert (s.outcome, s.backend, s.kvactors, s.transfer_mode) == (
        "selected", "mlu", True, "engine_driven")


def test_selection_two_musa_backends_need_the_env_var() -> None:
    s = predict_selection(_specs(musa=True, kvactors_musa=True), {})
    assert s.outcome == "error"
    assert "Multiple LMCache backends" in s.error
    s = predict_selection(_specs(musa=True, kvactors_musa=True),
                          {"LMCACHE_DEVICE_BACKEND": "kvactors_musa"})
    assert (s.outcome, s.backend) == ("selected", "kvactors_musa")


def test_selection_cpu_plugin_beats_accelerators() -> None:
    s = predict_selection(_specs(kvactors_cpu=True, mlu=True), {})
    assert s.backend == "kvactors_cpu"


def test_selection_unknown_or_unavailable_explicit_backend() -> None:
    assert "not a registered" in predict_selection(
        _specs(), {"LMCACHE_DEVICE_BACKEND": "nope"}).error
    assert "not available" in predict_selection(_specs(), {"LMCACHE_DEVICE_BACKEND": "mlu"}).error


def test_selection_transfer_modes() -> None:
    env = {"LMCACHE_DEVICE_BACKEND": "mlu", "LMCACHE_MP_TRANSFER_MODE": "lmcache_driven"}
    assert predict_selection(_specs(mlu=True), env).outcome == "error"
    env["LMCACHE_MP_TRANSFER_MODE"] = "engine_driven"
    assert predict_selection(_specs(mlu=True), env).outcome == "selected"
    env["LMCACHE_MP_TRANSFER_MODE"] = "bogus"
    assert "Invalid MP transfer mode" in predict_selection(_specs(mlu=True), env).error


def test_selection_device_type_falls_through_when_unavailable() -> None:
    s = predict_selection(_specs(mlu=True), {"DEVICE_TYPE": "cuda"})
    assert s.backend == "mlu"
    assert "DEVICE_TYPE=cuda has no available backend" in s.reason
