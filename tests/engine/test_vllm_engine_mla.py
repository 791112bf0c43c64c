"""The same engine with an MLA model: vLLM's CPU_MLA backend, LMCache format 3, kvactors_cpu.

One run of the serving validation with ``--model mla`` (a DeepSeek-V2-style model the test
writes itself). vLLM's CPU MLA backend serves no native prefix-cache hits, so the comparisons
with native prefix reuse are NOT APPLICABLE there, and batched MLA outputs depend on the batch,
so the preemption run's tokens are reported; the KV checks apply in full, also under preemption.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

BACKEND = os.environ.get("KVACTORS_ENGINE_BACKEND", "kvactors")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kvactors_serving.procedure import Options, run

    return run(Options(out=tmp_path_factory.mktemp("mla"), backend=BACKEND, repeats=1, model="mla"))


def _verdicts(rep: dict[str, Any]) -> dict[str, str]:
    return {c["check"]: c["verdict"] for c in rep["checks"]}


@pytest.mark.timeout(900)
def test_mla_kv_moves_bit_exact_through_kvactors(report: dict[str, Any]) -> None:
    v = _verdicts(report)
    assert report["verdict"] == "PASS", v
    assert v["KV bit equality, store vs restore (lmcache)"] == "PASS"
    assert v["KV bit equality, store vs restore (preempt)"] == "PASS"
    assert v["stored chunks vs LMCache's own op"] == (
        "PASS" if BACKEND == "kvactors" else "SKIPPED"
    )
    assert v["hit lengths"] == "PASS"
    pre = next(c for c in report["checks"] if c["check"] == "preemption: tokens vs the run without")
    assert pre["preemptions"] > 0
    assert pre["verdict"] == "REPORTED"  # MLA batches are not batch-invariant on vLLM CPU
    tap = report["engines"]["lmcache"]["tap"]
    assert tap["chunks_compared"] > 0
    assert tap["differential_chunks"] == tap["chunks_stored"] > 0 or BACKEND != "kvactors"


@pytest.mark.timeout(900)
def test_native_comparisons_say_why_they_do_not_apply(report: dict[str, Any]) -> None:
    v = _verdicts(report)
    assert v["one at a time: tokens and logprob bits vs native"] == "NOT APPLICABLE"
    assert v["batched: tokens vs native (logprob differences reported)"] == "NOT APPLICABLE"
    assert "MLA (format 3)" not in v
