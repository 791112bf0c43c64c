"""kvactors doctor: the report, JSON output, and LMCache's selection as LMCache itself answers.

The selection tests compare ``kvactors doctor --json`` (run as users run it, in a fresh process)
with an independent oracle that imports lmcache as an application would
(``tests/adapters/scripts/lmcache_selects.py``), for the same environment and fake device.
Nothing here restates LMCache's rules; each test also pins the one fact it is about, so it
fails when the doctor or the coexistence rule changes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvactors.cli import main
from kvactors.cli.doctor import ENV_VARS, collect

ORACLE = Path(__file__).resolve().parents[1] / "adapters" / "scripts" / "lmcache_selects.py"
LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
needs_lmcache = pytest.mark.skipif(LMCACHE_MISSING, reason="lmcache is not installed")
LMCACHE_057 = not LMCACHE_MISSING and importlib.metadata.version("lmcache").startswith("0.5.7")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVACTORS_"))}
    env.update(LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    for k in ("DEVICE_TYPE",):
        env.pop(k, None)
    env.update(extra)
    return env


def _last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON (rc {proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _start_doctor(env: dict[str, str], fake: str | None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvactors.cli", "doctor", "--json"]
    cmd += ["--fake", fake] if fake else []
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _start_oracle(env: dict[str, str], fake: str | None) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(ORACLE)] + (["--fake", fake] if fake else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _doctor_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "{" in proc.stdout, proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert proc.returncode == (0 if data["ok"] else 1)
    return data


def both(env: dict[str, str], fake: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The doctor's report and the oracle's answer for ``env``, computed side by side.

    The oracle always runs in a fresh process. With a fake device the doctor runs as users run
    it (``kvactors doctor --json --fake KIND``, a fresh process: a fake vendor module is
    per process); without one, in this process (its LMCache question still runs in a fresh
    subprocess with ``env``).
    """
    ora = _start_oracle(env, fake)
    if fake is None:
        report = collect(env)
        doc = msgspec.to_builtins(report) | {"ok": report.ok}
    else:
        doc = _doctor_json(_finish(_start_doctor(env, fake)))
    ora_done = _finish(ora)
    assert ora_done.returncode == 0, ora_done.stderr[-3000:]
    return doc, _last_json(ora_done)


def lmcache_says(env: dict[str, str], fake: str | None = None) -> dict[str, Any]:
    """The oracle alone: what LMCache itself selects with ``env`` (and a fake device)."""
    proc = _finish(_start_oracle(env, fake))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _last_json(proc)


def _same(pair: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """Assert the doctor reports exactly LMCache's answer; return the doctor's selection."""
    doc, oracle = pair
    sel = doc["selection"]
    if oracle["error"]:
        assert sel["outcome"] == "error", sel
        assert oracle["error"] in sel["error"], (sel, oracle)
    elif oracle.get("mode_error"):
        assert sel["outcome"] == "error", sel
        assert oracle["mode_error"] in sel["error"], (sel, oracle)
    else:
        assert sel["backend"] == oracle["backend"], (sel, oracle)
        assert sel["outcome"] == ("stub" if oracle["backend"] is None else "selected")
        assert sel["device_type"] == oracle["device_type"]
        assert sel["transfer_mode"] == oracle["mode"]
        assert sel["kvactors"] == str(oracle["backend"]).startswith("kvactors_")
        names = {t: [b["backend"] for b in sel["registry"] if b["device_type"] == t]
                 for t in oracle["registry"]}  # fmt: skip
        assert names == oracle["registry"]
    return sel


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for needle in ("backends:", "cpu   available", "LMCache selection (", "findings:",
                   "select kvactors: ", "KVACTORS_LMCACHE_CPU=1"):  # fmt: skip
        assert needle in out
    if not LMCACHE_MISSING:
        assert "detection, in a subprocess" in out
        assert "LMCACHE_DEVICE_BACKEND=kvactors_mlu" in out
        assert "LMCACHE_DEVICE_BACKEND=kvactors_musa" in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert {b["backend"] for b in data["backends"]} == {"cpu", "mlu", "musa", "cuda"}
    assert data["selection"]["outcome"] in (("absent",) if LMCACHE_MISSING else ("stub",))
    assert "torch" in data["packages"]


def test_doctor_without_lmcache_says_the_plugin_is_inactive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lmcache" else real(name, *a))  # fmt: skip
    report = collect({})
    assert report.selection.outcome == "absent"
    assert not report.selection.registry


@needs_lmcache
def test_doctor_flags_unavailable_explicit_backend(capsys: pytest.CaptureFixture[str]) -> None:
    env = _env(LMCACHE_DEVICE_BACKEND="kvactors_musa")
    report = collect(env)
    oracle = lmcache_says(env)
    assert oracle["error"]
    assert "registered but not available" in oracle["error"]
    assert report.selection.outcome == "error"
    assert oracle["error"] in report.selection.error
    assert not report.ok
    fail = next(f for f in report.findings if f.level == "error")
    assert "torch_musa" in fail.fix  # says why kvactors' backend cannot run


# -- LMCache's real detection vs the doctor (fresh processes on both sides) ------------------


@needs_lmcache
def test_selection_nothing_available_is_the_stub() -> None:
    env = _env()
    sel = _same(both(env))
    assert sel["outcome"] == "stub"


@needs_lmcache
def test_selection_mlu_auto() -> None:
    env = _env()
    pair = both(env, "mlu")
    doc, sel = pair[0], _same(pair)
    # kvactors_mlu is auto-selected only where LMCache has no MLU backend of its own.
    builtin_mlu = any(b["backend"] == "mlu" for b in sel["registry"])
    assert builtin_mlu == LMCACHE_057
    assert sel["backend"] == ("mlu" if builtin_mlu else "kvactors_mlu")
    if builtin_mlu:
        fix = next(f["fix"] for f in doc["findings"] if f["topic"] == "LMCache selection")
        assert "export LMCACHE_DEVICE_BACKEND=kvactors_mlu" in fix


@needs_lmcache
def test_selection_musa_coexists_and_selects_by_name() -> None:
    env = _env()
    sel = _same(both(env, "musa"))
    assert sel["backend"] == "musa"  # the built-in: installing kvactors changed nothing
    env = _env(LMCACHE_DEVICE_BACKEND="kvactors_musa")
    sel = _same(both(env, "musa"))
    assert sel["backend"] == "kvactors_musa"


@needs_lmcache
def test_selection_cpu_plugin_beats_accelerators() -> None:
    env = _env(KVACTORS_LMCACHE_CPU="1")
    pair = both(env, "mlu")
    doc, sel = pair[0], _same(pair)
    assert sel["backend"] == "kvactors_cpu"
    assert any(f["topic"] == "KVACTORS_LMCACHE_CPU" and f["level"] == "warn"
               for f in doc["findings"])  # fmt: skip


@needs_lmcache
def test_selection_unknown_or_unavailable_explicit_backend() -> None:
    for name, needle in (("nope", "is not registered"),
                         ("kvactors_mlu", "registered but not available")):  # fmt: skip
        env = _env(LMCACHE_DEVICE_BACKEND=name)
        sel = _same(both(env))
        assert needle in sel["error"]


@needs_lmcache
def test_selection_transfer_modes() -> None:
    env = _env(LMCACHE_DEVICE_BACKEND="kvactors_mlu", LMCACHE_MP_TRANSFER_MODE="lmcache_driven")
    sel = _same(both(env, "mlu"))
    assert sel["outcome"] == "error"
    env["LMCACHE_MP_TRANSFER_MODE"] = "bogus"
    sel = _same(both(env, "mlu"))
    assert "Invalid MP transfer mode" in sel["error"]


@needs_lmcache
def test_selection_device_type_falls_through_when_unavailable() -> None:
    env = _env(DEVICE_TYPE="cuda")
    sel = _same(both(env, "mlu"))
    assert sel["device_type"] == "mlu"


# -- the LMCache server's hash, torch_mlu's CUDA migration (issue 30, items 5 and 6) ----------


def _proc_tree(root: Path, procs: dict[int, list[str]]) -> Path:
    for pid, argv in procs.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()
    return root


def test_lmcache_servers_are_read_from_their_command_lines(tmp_path: Path) -> None:
    from kvactors.cli.doctor import lmcache_servers

    server = ["python", "-m", "lmcache.v1.multiprocess.server", "--port", "6555"]
    root = _proc_tree(
        tmp_path,
        {
            11: [*server, "--hash-algorithm", "builtin", "--l2-adapter", '{"type":"resp"}'],
            12: server,  # LMCache's default hash
            13: [*server, "--hash-algorithm=sha256_cbor"],
            14: ["python", "-m", "vllm.entrypoints.openai.api_server", "--hash-algorithm", "x"],
        },
    )
    found = {s.pid: (s.hash_algorithm, s.l2_adapters) for s in lmcache_servers(root)}
    assert found == {11: ("builtin", 1), 12: ("blake3", 0), 13: ("sha256_cbor", 0)}


def test_a_builtin_hash_warns_that_l2_is_lost_on_restart_and_blake3_is_ok() -> None:
    from kvactors.cli.doctor import LMCacheServerProcess, hash_findings

    builtin, blake3 = hash_findings(
        [
            LMCacheServerProcess(pid=1, hash_algorithm="builtin", l2_adapters=1),
            LMCacheServerProcess(pid=2, hash_algorithm="blake3", l2_adapters=1),
        ]
    )
    assert builtin.level == "warn"
    assert "after a restart it finds none of what its L2 holds" in builtin.message
    assert "--hash-algorithm blake3" in builtin.fix
    assert blake3.level == "ok"


@pytest.mark.timeout(120)
def test_doctor_warns_about_a_running_server_with_the_builtin_hash() -> None:
    """As users run it: a process whose command line is an LMCache server's (one that carries
    those arguments and lives until its stdin closes; the doctor reads only the command line)."""
    argv = ["-c", "import sys; sys.stdin.read()", "lmcache.v1.multiprocess.server",
            "--hash-algorithm", "builtin"]  # fmt: skip
    sleeper = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvactors.cli", "doctor", "--json"],
            env=_env(), capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip
    finally:
        sleeper.communicate(timeout=10)  # closes its stdin: it ends
    doc = json.loads(proc.stdout[proc.stdout.index("{") :])
    mine = [s for s in doc["lmcache_servers"] if s["pid"] == sleeper.pid]
    assert mine == [{"pid": sleeper.pid, "hash_algorithm": "builtin", "l2_adapters": 0}]
    warns = [f for f in doc["findings"] if f["topic"] == "LMCache hash" and f["level"] == "warn"]
    assert any(f"pid {sleeper.pid} " in f["message"] for f in warns), warns


def _masquerade() -> bool:
    return True


def test_cuda_masquerade_is_seen_when_torch_cuda_is_torch_mlus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from kvactors.cli.doctor import cuda_masquerades

    assert not cuda_masquerades()
    fn = _masquerade
    monkeypatch.setattr(fn, "__module__", "torch_mlu.utils.gpu_migration")
    monkeypatch.setattr(torch.cuda, "is_available", fn)
    assert cuda_masquerades()


@pytest.mark.parametrize(
    ("backend", "kvactors", "level"), [("cuda", False, "warn"), ("kvactors_mlu", True, "ok")]
)
def test_the_selection_under_cuda_migration_is_judged(
    backend: str, kvactors: bool, level: str
) -> None:
    from kvactors.cli.doctor import Selection, collect, migration_rule

    base = collect(_env())
    sel = Selection(outcome="selected", backend=backend, device_type="cuda", kvactors=kvactors)
    report = msgspec.structs.replace(
        base, cuda_migration="available", selection_under_migration=sel
    )
    (finding,) = migration_rule(report)
    assert finding.level == level
    assert f"LMCache selects {backend}" in finding.message
    if level == "warn":
        assert "LMCACHE_DEVICE_BACKEND=kvactors_mlu" in finding.fix
    assert migration_rule(msgspec.structs.replace(report, cuda_migration="absent")) == []


@needs_lmcache
@pytest.mark.timeout(200)
def test_asking_lmcache_under_cuda_migration_imports_the_module_first() -> None:
    """Here torch_mlu is absent: the subprocess fails on that import, and says so."""
    from kvactors.cli.doctor import CUDA_MIGRATION_MODULE, ask_lmcache

    sel = ask_lmcache(_env(), cuda_migration=True)
    assert sel.outcome == "unknown"
    assert "torch_mlu" in sel.error
    assert CUDA_MIGRATION_MODULE.startswith("torch_mlu.")
