"""Every example runs from an installed wheel, outside the source tree (the one place the
examples run in the test job).

The wheel is built from this checkout (``pip wheel --no-deps``, hatchling from the configured
index) and installed with its dependencies into a fresh virtual environment that sees no
site-packages of this one, so a dependency the wheel does not declare fails here. torch is
pinned to the main venv's version (``scripts/setup.sh``'s default), whose CPU wheel is on
local disk; the torch-matrix venvs test other versions with the rest of the suite. Each file of
``examples/`` is copied into an empty directory and run there with no ``PYTHONPATH``, so an
example that reaches into ``tests/`` or the checkout fails here.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import venv
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TORCH = "2.13.0"
"""The torch of the main venv (``TORCH_MAIN`` in ``scripts/setup.sh``)."""


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
        and not k.startswith(("KVACTORS_", "LMCACHE_"))
    }
    env["LMCACHE_TRACK_USAGE"] = "false"
    return env


def _run(args: list[str], cwd: pathlib.Path, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args} did not finish within {timeout:.0f} s: {exc.stdout!r}")
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """The ``python`` of a fresh venv holding the wheel of this checkout (removed after)."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        base,
        300,
    )
    (wheel,) = dist.glob("kvactors-*.whl")
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", str(wheel), f"torch=={TORCH}"], base, 600)
    yield python
    shutil.rmtree(base, ignore_errors=True)  # about 1 GB, torch mostly


def test_the_wheel_is_what_runs(installed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _run(
        [str(installed), "-c", "import kvactors, kvactors.testing; print(kvactors.__file__)"],
        tmp_path,
        120,
    ).stdout
    assert pathlib.Path(out.strip()).is_relative_to(installed.parents[1])
    demo = _run([str(installed.parent / "kvactors"), "demo", "--requests", "8"], tmp_path, 120)
    assert "PASS" in demo.stdout


def _example(installed: pathlib.Path, cwd: pathlib.Path, name: str, *args: str) -> str:
    """Run ``examples/<name>`` from an empty directory with the wheel's python."""
    shutil.copy(ROOT / "examples" / name, cwd / name)
    out = _run([str(installed), name, *args], cwd, 300).stdout
    results = [line.strip() for line in out.splitlines() if line.strip().startswith("RESULT:")]
    assert results, out
    return out


def test_every_example_has_a_case_here() -> None:
    assert {p.name for p in EXAMPLES} == {
        "preemption.py",
        "lmcache_worker.py",
        "ipc_cross_process.py",
    }


@pytest.mark.parametrize(
    ("device", "seed"), [("cpu", 1), ("cpu", 2), ("cpu", 3), ("mlu", 4), ("musa", 5)]
)
def test_preemption_example_shows_the_race_and_the_fence_ends_it(
    installed: pathlib.Path, tmp_path: pathlib.Path, device: str, seed: int
) -> None:
    args = ["--device", device, "--seed", str(seed), "--require-race"]
    if device != "cpu":
        args += ["--requests", "16"]
    out = _example(installed, tmp_path, "preemption.py", *args)
    line = next(ln for ln in out.splitlines() if "CORRUPTED committed chunks" in ln)
    naive, fenced = (int(x) for x in line.split()[-2:])
    assert naive > 0
    assert fenced == 0
    assert "RESULT: naive run committed" in out


def test_lmcache_worker_example_commits_every_store_bit_exact_in_order(
    installed: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # Not a sync-then-publish test: each store's gather is complete when transfer() returns,
    # so the record cannot overtake its bytes here (rule 1 is tested in tests/actors).
    for args in ((), ("--stores", "32")):
        assert "RESULT: OK" in _example(installed, tmp_path, "lmcache_worker.py", *args)


def test_ipc_cross_process_example(installed: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _example(installed, tmp_path, "ipc_cross_process.py")
    assert "RESULT: OK" in out
    assert "server killed" in out
    assert "worker killed" in out


def test_the_torch_pin_is_the_main_venvs() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f'TORCH_MAIN="{TORCH}"' in setup


def test_the_wheel_ships_no_harness_and_validate_serving_says_so(
    installed: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """The deployment harness (a checkout's tools/kvactors_serving) is not in the wheel, and
    ``kvactors validate-serving`` from the install says so in one line (exit 2), no traceback."""
    found = _run(
        [
            str(installed),
            "-c",
            "import importlib.util as u; print(u.find_spec('kvactors_serving'),"
            " u.find_spec('kvactors_lmcache.serving'))",
        ],
        tmp_path,
        120,
    ).stdout
    assert found.split() == ["None", "None"]
    proc = subprocess.run(
        [str(installed.parent / "kvactors"), "validate-serving", "--out", "report"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kvactors validate-serving: the serving harness"), line
    assert not (tmp_path / "report").exists()
