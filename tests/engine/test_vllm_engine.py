"""vLLM's CPU build serving a tiny model through LMCache's MP connector with kvactors moving the KV.

Runs in the engine's venv (``scripts/setup-engine.sh``; ``scripts/test.sh`` runs
``.venv-vllm/bin/python -m pytest tests/engine``). One run of the serving validation
(``kvactors_serving``: a native-prefix-caching engine, an LMCache engine with the
``kvactors_cpu`` plugin, a preempting LMCache engine, two LMCache servers on loopback) is shared
by the tests, which check its figures; a second, short run with a broken restore must fail and
name the chunk. CPU copies complete before the op returns: what this covers and what only the
fake-device scenarios cover is in docs/validation.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

#: The ops the engines use: kvactors' plugin unless KVACTORS_ENGINE_BACKEND=lmcache.
BACKEND = os.environ.get("KVACTORS_ENGINE_BACKEND", "kvactors")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kvactors_serving.procedure import Options, run

    out = tmp_path_factory.mktemp("serving")
    rep = run(Options(out=out, backend=BACKEND, repeats=2))
    rep["_out"] = str(out)
    return rep


def _check(rep: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in rep["checks"] if c["check"] == name]
    assert len(found) == 1, [c["check"] for c in rep["checks"]]
    return found[0]


@pytest.mark.timeout(900)
def test_every_check_passes_and_the_outputs_are_written(report: dict[str, Any]) -> None:
    out = Path(report["_out"])
    assert report["verdict"] == "PASS", json.dumps(
        [c for c in report["checks"] if c["verdict"] == "FAIL"], indent=1
    )[:6000]
    assert json.loads((out / "report.json").read_text())["verdict"] == "PASS"
    assert (out / "logprob-diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS" in (out / "report.txt").read_text()


@pytest.mark.timeout(900)
def test_hits_equal_native_prefix_caching_aligned_unaligned_and_zero(
    report: dict[str, Any],
) -> None:
    c = _check(report, "hit lengths")
    assert c["verdict"] == "PASS"
    hits = {r["prompt"]: (r["native"], r["lmcache"]) for r in c["hits"]}
    assert hits["hit256-a"] == (256, 256)
    assert hits["hit256-of-261"] == (256, 256)  # 261 shared tokens: not chunk-aligned
    assert hits["hit64-of-84"] == (64, 64)
    assert hits["miss"] == (0, 0)
    assert hits["hit64"] == (64, 64)


@pytest.mark.timeout(900)
def test_kvactors_served_the_worker_and_moved_the_hits(report: dict[str, Any]) -> None:
    c = _check(report, "kvactors moved the KV")
    if BACKEND != "kvactors":  # LMCache's own ops served: the report says so and names them
        assert c["verdict"] == "SKIPPED", c
        assert not c["ops"].startswith("kvactors_lmcache."), c
        return
    assert c["ops"] == "kvactors_lmcache.ops.KvactorsCpuOps"
    assert c["verdict"] == "PASS", c
    assert c["runtime"]["transfers_ok"] > 0
    assert c["runtime"]["bytes_moved"] == c["expected_bytes"] > 0
    assert _check(report, "stored chunks vs LMCache's own op")["verdict"] == "PASS"


@pytest.mark.timeout(900)
def test_every_restored_chunk_is_bit_identical_also_under_preemption(
    report: dict[str, Any],
) -> None:
    for name in ("lmcache", "preempt"):
        c = _check(report, f"KV bit equality, store vs restore ({name})")
        assert c["verdict"] == "PASS", c
        tap = report["engines"][name]["tap"]
        assert tap["chunks_compared"] > 0
        assert tap["layer_blocks_compared"] > 0
    pre = _check(report, "preemption: tokens vs the run without")
    assert pre["verdict"] == "PASS", pre


@pytest.mark.timeout(900)
def test_single_requests_are_bit_exact_and_batches_are_reported(report: dict[str, Any]) -> None:
    assert _check(report, "one at a time: tokens and logprob bits vs native")["verdict"] == "PASS"
    assert _check(report, "repeated runs (one at a time)")["verdict"] == "PASS"
    batched = _check(report, "batched: tokens vs native (logprob differences reported)")
    assert batched["verdict"] == "PASS"
    for run in batched["runs"]:
        assert run["native_steps"]
        assert run["lmcache_steps"]
        assert set(run["max_abs_logprob_diff"]) == {
            r["prompt"] for r in _check(report, "hit lengths")["hits"]
        }
    assert _check(report, "synchronization control")["verdict"] == "NOT APPLICABLE"


@pytest.mark.timeout(600)
def test_a_broken_restore_fails_and_names_the_chunk(tmp_path: Path) -> None:
    from kvactors_serving.procedure import Options, run

    rep = run(
        Options(
            out=tmp_path, backend=BACKEND, repeats=1, corrupt_restore=True, configs=("lmcache",)
        )
    )
    assert rep["verdict"] == "FAIL"
    c = _check(rep, "KV bit equality, store vs restore (lmcache)")
    assert c["verdict"] == "FAIL"
    (corrupted,) = c["corrupted"]
    chunk = corrupted.split()[1]
    assert c["mismatches"]
    assert all(m.startswith(f"chunk {chunk} ") for m in c["mismatches"])
