"""The tested torch range: one constant, the doctor's verdict on it, and the places that must agree.

``kvactors.cli.torch_range.TORCH_TESTED`` is the one place the range lives; the floor in
pyproject.toml, the oldest torch of scripts/setup.sh's matrix and the README's "Supported torch"
section are checked against it here, so changing one without the others fails.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch

from kvactors.cli.doctor import collect, format_doctor
from kvactors.cli.torch_range import TORCH_TESTED, torch_placement, torch_range_advice

ROOT = Path(__file__).resolve().parents[2]
NO_VENDOR: dict[str, str | None] = {"torch_mlu": None, "torch_musa": None}


@pytest.mark.parametrize(
    ("version", "placement"),
    [
        ("2.6.0", "older"),
        ("2.4.1+cu121", "older"),
        ("1.13.1", "older"),
        ("2.7.0", "inside"),
        ("2.7.1+cu126", "inside"),
        ("2.9.0a0+git1234", "inside"),
        ("2.13.0+cpu", "inside"),
        ("2.13.9", "inside"),
        ("2.14.0", "newer"),
        ("3.0.0", "newer"),
        ("nightly", "unknown"),
        ("", "unknown"),
    ],
)
def test_placement(version: str, placement: str) -> None:
    assert torch_placement(version) == placement


def test_advice_inside_is_ok_without_a_fix() -> None:
    level, message, fix = torch_range_advice("2.9.1", NO_VENDOR)
    assert (level, fix) == ("ok", "")
    assert message == "torch 2.9.1 is inside the tested range 2.7-2.13"


def test_advice_older_with_a_vendor_stack_never_says_replace_torch() -> None:
    level, message, fix = torch_range_advice("2.2.0", {"torch_mlu": None, "torch_musa": "2.0.0"})
    assert level == "warn"
    assert "torch 2.2.0 (with torch_musa 2.0.0) is older" in message
    assert "torch>=2.7" in message
    assert "upgrade the whole vendor stack" in fix
    assert "never replace torch_musa's torch alone" in fix
    assert "pip install" not in fix


def test_advice_older_without_a_vendor_names_the_pip_range() -> None:
    level, _, fix = torch_range_advice("2.1.2", NO_VENDOR)
    assert level == "warn"
    assert "pip install 'torch>=2.7,<2.14'" in fix


def test_advice_newer_says_how_to_check() -> None:
    level, message, fix = torch_range_advice("2.15.0", {"torch_mlu": "1.30.0", "torch_musa": None})
    assert level == "warn"
    assert "newer than the newest torch kvactors is tested on (2.13" in message
    assert "kvactors selftest" in fix
    assert "keep the vendor stack's torch" in fix


def test_advice_unreadable_version() -> None:
    level, message, fix = torch_range_advice("weird", NO_VENDOR)
    assert level == "warn"
    assert "cannot read a major.minor version" in message
    assert "kvactors selftest" in fix


def test_doctor_reports_the_running_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec  # no LMCache question: not what this test is about
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lmcache" else real(name, *a))  # fmt: skip
    report = collect({})
    assert report.torch == torch.__version__
    assert report.torch_tested == "inside"  # every torch the test job runs is inside
    finding = next(f for f in report.findings if f.topic == "torch")
    assert finding.level == "ok"
    text = format_doctor(report)
    assert f"torch {torch.__version__} is inside" in text
    assert f"\ntorch {torch.__version__}: inside the tested range 2.7-2.13\n" in text

    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    old = collect({})
    assert (old.torch, old.torch_tested) == ("2.6.0+cpu", "older")
    finding = next(f for f in old.findings if f.topic == "torch")
    assert finding.level == "warn"
    assert "older than the oldest torch" in finding.message
    text = format_doctor(old)
    assert "[WARN] torch: torch 2.6.0+cpu is older" in text
    assert "\ntorch 2.6.0+cpu: older than the tested range 2.7-2.13\n" in text


def _floor(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


def test_pyproject_floor_is_the_oldest_tested_torch() -> None:
    # A regex, not tomllib: the tests stay importable on Python 3.10.
    specs = re.findall(r'^\s*"(torch[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    assert len(specs) == 1, specs
    assert specs[0].startswith("torch>=")
    assert _floor(specs[0].removeprefix("torch>=")) == TORCH_TESTED[0]


def test_setup_matrix_starts_at_the_floor() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--matrix"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    versions = [line.split()[1] for line in out.splitlines()]
    assert versions, out
    oldest = min(_floor(".".join(v.split(".")[:2])) for v in versions)
    assert oldest == TORCH_TESTED[0]
    assert max(_floor(".".join(v.split(".")[:2])) for v in versions) <= TORCH_TESTED[1]


def test_readme_states_the_tested_range() -> None:
    readme = (ROOT / "README.md").read_text()
    lo, hi = (f"{a}.{b}" for a, b in TORCH_TESTED)
    assert "## Supported torch" in readme
    section = readme.split("## Supported torch", 1)[1].split("\n## ", 1)[0]
    assert f"{lo}-{hi}" in section
