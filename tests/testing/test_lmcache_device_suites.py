"""LMCache's own MLU and MUSA device tests, from its released sdist, run on kvactors' fakes.

LMCache ships hardware-gated device suites (``tests/v1/platform/devices/mlu`` and ``.../musa``)
written for a real card. This test runs the suite of the LMCache version installed in this
venv, for the fake vendor this process belongs to (``KVACTORS_FAKE_VENDOR``, one vendor per
process as ``scripts/test.sh`` runs them), in a child pytest with the fake installed for the
whole session (``-p kvactors.testing.pytest_plugin --kvactors-fake-vendor=<kind>``) and
LMCache's root conftest left out (it needs the whole serving stack); the session's spawned
children install the fake too, so LMCache's two-process IPC tests cross a real process
boundary (knob ``cross_process``). It fails on any outcome that :data:`EXPECTED` does not
name: a failure or a skip of a test not listed, and a listed test that now passes or no
longer runs (the list must stay short and true).

The sdists come from ``scripts/fetch-lmcache-sdists.sh`` (PyPI files, pinned digests) into
``KVACTORS_LMCACHE_SDISTS`` (default ``~/.cache/kvactors/lmcache-sdists``); when that variable
is set (CI) a missing sdist fails, otherwise the test skips and names the script.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.lmcache

ENV_SDISTS = "KVACTORS_LMCACHE_SDISTS"
SUITES = {
    "mlu": "tests/v1/platform/devices/mlu",
    "musa": "tests/v1/platform/devices/musa",
}
VERSIONS = ("0.5.6", "0.5.7rc2")
# (version, vendor) whose sdist has no device suite (LMCache's MLU backend came in 0.5.7):
# checked against the sdist, so a release that adds one fails until it is run here.
NO_SUITE = {("0.5.6", "mlu")}
# Modules LMCache imports at module level for backends its device tests never use
# (aiofile: the GDS backend; transformers: CacheGen's config loader). When the venv lacks
# one, the child gets a stand-in that raises if anything calls it.
STAND_INS = {
    "aiofile": "def async_open(*args, **kwargs):\n    raise RuntimeError(_MISSING)\n",
    "transformers": (
        "class _StandIn:\n"
        "    @classmethod\n"
        "    def from_pretrained(cls, *args, **kwargs):\n"
        "        raise RuntimeError(_MISSING)\n\n\n"
        "class AutoConfig(_StandIn):\n    pass\n\n\n"
        "class AutoTokenizer(_StandIn):\n    pass\n"
    ),
}


@dataclasses.dataclass(frozen=True)
class Expected:
    """An upstream test whose outcome on the fakes is known and is not a fake's fault."""

    test: str  # "file.py::name" under the suite directory
    outcome: str  # "failed" or "skipped"
    reason: str
    vendor: str
    versions: tuple[str, ...] = VERSIONS


_FALLBACK_SKIP = (
    "skips by design whenever a MUSA runtime is present (its skipif asks for LMCache's "
    "Python fallback backend), so on a real card too"
)
EXPECTED: tuple[Expected, ...] = (
    Expected(
        "test_musa_mp_block_transfer.py::test_musa_cache_context_sglang_mha_operand_round_trip",
        "failed",
        "LMCache's own test: its SGLang detector takes the MHA path only with a "
        "kv_list_layout hint the test does not pass; it fails on plain CPU tensors too",
        "musa",
    ),
    *(
        Expected(f"test_musa_mp_block_transfer.py::{name}", "skipped", _FALLBACK_SKIP, "musa")
        for name in (
            "test_musa_block_transfer_fallback_non_mla_d2h_and_h2d",
            "test_musa_block_transfer_fallback_mla_d2h_and_h2d",
            "test_musa_block_transfer_fallback_repeated_round_trip",
            "test_musa_block_transfer_fallback_sglang_mha_d2h_and_h2d",
            "test_musa_block_transfer_rejects_unvalidated_layout",
        )
    ),
)


def expected_for(version: str, vendor: str) -> dict[str, Expected]:
    """The :data:`EXPECTED` entries of one (LMCache version, vendor) suite, by test id."""
    return {e.test: e for e in EXPECTED if e.vendor == vendor and version in e.versions}


def sdist_path(version: str) -> pathlib.Path:
    """Where ``scripts/fetch-lmcache-sdists.sh`` puts LMCache ``version``'s sdist."""
    default = pathlib.Path(
        os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache",
        "kvactors",
        "lmcache-sdists",
    )
    return pathlib.Path(os.environ.get(ENV_SDISTS) or default) / f"lmcache-{version}.tar.gz"


def extract_suite_tree(sdist: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The sdist's tests and repository files, without LMCache's own sources (the installed
    wheel is what runs) and without its root conftest; returns the tree's root."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        skip = tuple(f"{top}/{d}/" for d in ("lmcache", "csrc", "rust"))
        members = [
            m
            for m in tar.getmembers()
            if not m.name.startswith(skip) and m.name != f"{top}/tests/conftest.py"
        ]
        tar.extractall(dest, members=members, filter="data")
    return dest / top


def outcomes(junit: pathlib.Path) -> dict[str, str]:
    """Test id ("file.py::name") -> passed / failed / skipped, from a junit (xunit1) file."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{pathlib.Path(case.get('file', '')).name}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            out[test] = "failed"
        elif "skipped" in tags:
            out[test] = "skipped"
        else:
            out[test] = "passed"
    return out


def judge(results: dict[str, str], expected: dict[str, Expected]) -> list[str]:
    """What differs from the expected outcomes (empty: the suite is as expected)."""
    problems: list[str] = []
    for test, outcome in sorted(results.items()):
        exp = expected.get(test)
        if exp is None and outcome != "passed":
            problems.append(f"{test}: {outcome}, not an expected outcome")
        elif exp is not None and outcome != exp.outcome:
            problems.append(
                f"{test}: {outcome}, expected {exp.outcome} ({exp.reason}); update EXPECTED"
            )
    for test, exp in sorted(expected.items()):
        if test not in results:
            problems.append(f"{test}: listed as expected {exp.outcome} but did not run")
    return problems


def _stand_ins(dest: pathlib.Path) -> list[str]:
    made = []
    for name, body in STAND_INS.items():
        if importlib.util.find_spec(name) is None:
            pkg = dest / name
            pkg.mkdir(parents=True)
            missing = f"{name} is not installed (a stand-in for LMCache's device tests)"
            (pkg / "__init__.py").write_text(f"_MISSING = {missing!r}\n\n\n{body}")
            made.append(name)
    return made


def test_judge_flags_unexpected_failures_skips_passes_and_missing_tests() -> None:
    expected = {
        "a.py::known": Expected("a.py::known", "failed", "why", "musa"),
        "a.py::gone": Expected("a.py::gone", "skipped", "why", "musa"),
    }
    results = {"a.py::known": "failed", "a.py::ok": "passed", "a.py::gone": "skipped"}
    assert judge(results, expected) == []
    results = {"a.py::known": "passed", "a.py::new": "skipped", "a.py::bad": "failed"}
    problems = judge(results, expected)
    assert problems[0] == "a.py::bad: failed, not an expected outcome"
    assert problems[1].startswith("a.py::known: passed, expected failed")
    assert problems[2] == "a.py::new: skipped, not an expected outcome"
    assert problems[3] == "a.py::gone: listed as expected skipped but did not run"


def test_lmcache_device_suite_runs_on_the_fake(tmp_path: pathlib.Path) -> None:
    """LMCache's device suite of this venv's version and this process's vendor, on the fake:
    every test passes but those :data:`EXPECTED` names, with the outcome it names."""
    pytest.importorskip("lmcache")
    version = importlib.metadata.version("lmcache")
    vendor = os.environ.get("KVACTORS_FAKE_VENDOR", "mlu")
    assert version in VERSIONS, f"LMCache {version} is not a version this test knows"
    sdist = sdist_path(version)
    if not sdist.exists():  # fetched here (the script is a no-op once the files are there)
        fetch = pathlib.Path(__file__).parents[2] / "scripts" / "fetch-lmcache-sdists.sh"
        subprocess.run(["bash", str(fetch)], check=False, capture_output=True, timeout=300)
    assert sdist.exists(), f"{sdist} is missing: run scripts/fetch-lmcache-sdists.sh"
    root = extract_suite_tree(sdist, tmp_path / "sdist")
    has_suite = (root / SUITES[vendor]).is_dir()
    if (version, vendor) in NO_SUITE:
        assert not has_suite, f"LMCache {version} now ships {SUITES[vendor]}: run it"
        return
    assert has_suite, f"LMCache {version}'s sdist has no {SUITES[vendor]}"

    expected = expected_for(version, vendor)
    stand_ins = _stand_ins(tmp_path / "stand_ins")
    junit = tmp_path / "junit.xml"
    env = {
        **os.environ,
        "KVACTORS_FAKE_VENDOR": vendor,
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONHASHSEED": "0",
    }
    if stand_ins:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(tmp_path / "stand_ins"), os.environ.get("PYTHONPATH")) if p
        )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "kvactors.testing.pytest_plugin",
        f"--kvactors-fake-vendor={vendor}",
        "--noconftest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "-o",
        "log_cli=false",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={junit}",
        SUITES[vendor],
    ]
    proc = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode in (0, 1), f"the child pytest exited {proc.returncode}:\n{tail}"
    results = outcomes(junit)
    counts = {
        k: sum(1 for v in results.values() if v == k) for k in ("passed", "failed", "skipped")
    }
    print(
        f"LMCache {version} {vendor.upper()} suite on the fake: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped"
        f" (stand-ins: {', '.join(stand_ins) or 'none'})"
    )
    assert results, f"the child pytest ran no tests:\n{tail}"
    problems = judge(results, expected)
    assert not problems, "\n".join(problems) + f"\n\n{tail}"
