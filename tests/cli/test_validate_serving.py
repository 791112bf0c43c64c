"""``kvactors validate-serving``: starts the procedure in the engine's interpreter."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvactors.cli import main, parse_args, serving
from kvactors.cli.serving import NO_HARNESS, engine_python, harness_folder

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_interpreter_is_explicit_or_the_engine_venv(tmp_path, monkeypatch) -> None:
    assert engine_python("/opt/engine/bin/python") == "/opt/engine/bin/python"
    monkeypatch.chdir(tmp_path)
    assert engine_python(None) == sys.executable  # no .venv-vllm here
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert engine_python(None) == ".venv-vllm/bin/python"


def test_the_procedure_flags_pass_through() -> None:
    args = parse_args(["validate-serving", "--python", "py", "--repeats", "5", "--corrupt-restore"])
    assert args.python == "py"
    assert args.procedure_args == ["--repeats", "5", "--corrupt-restore"]
    with pytest.raises(SystemExit):
        parse_args(["doctor", "--repeats", "5"])  # other commands refuse unknown flags


def test_the_harness_is_found_in_the_checkout_from_anywhere(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no tools/ here: the checkout kvactors is imported from
    assert harness_folder(None) == ROOT / "tools"
    assert harness_folder(str(ROOT / "tools")) == ROOT / "tools"
    assert harness_folder(str(tmp_path)) is None  # --tools names a folder without it


def test_the_procedure_gets_the_harness_first_on_its_path(tmp_path, monkeypatch) -> None:
    """The engine's interpreter is started as ``PY -m kvactors_serving ARGS`` with the
    checkout's tools/ first on PYTHONPATH (a stand-in interpreter records what it got)."""
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$PYTHONPATH" "$@" > {seen}\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.chdir(tmp_path)
    assert main(["validate-serving", "--python", str(fake), "--repeats", "5"]) == 1
    path, *argv = seen.read_text().splitlines()
    assert path.split(os.pathsep) == [str(ROOT / "tools"), "/elsewhere"]
    assert argv == ["-m", "kvactors_serving", "--repeats", "5"]


def test_without_a_checkout_the_command_says_so_once(tmp_path, monkeypatch, capsys) -> None:
    """An install without a checkout (the wheel ships no harness): one line, exit 2, nothing
    started."""
    monkeypatch.setattr(serving, "CHECKOUT_TOOLS", tmp_path / "site-packages" / "tools")
    monkeypatch.chdir(tmp_path)
    assert main(["validate-serving", "--python", "/nonexistent/python"]) == 2
    assert capsys.readouterr().err == NO_HARNESS + "\n"
    assert main(["validate-serving", "--tools", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_HARNESS)
    assert f"--tools {tmp_path} holds no kvactors_serving package" in err


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="lmcache not installed")
def test_the_procedure_starts_in_the_given_interpreter(capfd, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["validate-serving", "--python", sys.executable, "--help"]) == 0
    out = capfd.readouterr().out
    assert "--corrupt-restore" in out
    assert "--bench" in out


def test_the_report_is_written_without_matplotlib(tmp_path, monkeypatch, capsys) -> None:
    """matplotlib is optional (the bench extra): without it the report is still written and
    the plot is left out with a line that says how to get it, never a traceback."""
    procedure = pytest.importorskip("kvactors_serving.procedure")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` fails
    report = {
        "device": "cpu",
        "model": "llama",
        "backend": "kvactors",
        "verdict": "PASS",
        "checks": [{"check": "warm", "verdict": "PASS", "detail": "5/5 identical"}],
        "plot": {},
    }
    procedure.write(procedure.Options(out=tmp_path), report)
    assert (tmp_path / "report.json").is_file()
    assert "5/5 identical" in (tmp_path / "report.txt").read_text()
    assert not (tmp_path / "logprob-diff.png").exists()
    assert "pip install 'kvactors[bench]'" in capsys.readouterr().err
