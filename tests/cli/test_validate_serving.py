"""``kvactors validate-serving``: starts the procedure in the engine's interpreter."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kvactors.cli import parse_args
from kvactors.cli.serving import engine_python


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


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="lmcache not installed")
def test_the_procedure_starts_in_the_given_interpreter(capfd) -> None:
    from kvactors.cli import main

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
