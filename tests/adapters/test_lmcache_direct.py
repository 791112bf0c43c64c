"""LMCache's gather/scatter callers with the kvactors plugin vs LMCache's built-in CPU ops."""

from __future__ import annotations

import importlib.metadata

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON, lmcache_env, run_script

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def test_gather_scatter_bit_exact_against_builtin() -> None:
    res = run_script("direct_gather_scatter.py", env=lmcache_env(KVACTORS_LMCACHE_CPU="1"))
    assert res["ops_type"] == "kvactors_lmcache.ops.KvactorsCpuOps"
    seen = {c["case"] for c in res["cases"]}
    expected = {
        "nhd", "hnd", "mla", "sglang", "mla_padded",
        "fused_hnd", "fused_nhd", "fused_hnd_blocks_first",
    }  # fmt: skip
    if importlib.metadata.version("lmcache").startswith("0.5.7"):
        # 0.5.7's callers: window-sized chunks and window-relative skips (sliding window).
        expected.add("nhd_window1")
    assert seen == expected
    formats = {c["case"]: c["format"] for c in res["cases"]}
    # vLLM's blocks-first fused K/V as LMCache's detector names it (12: vLLM CPU attention).
    assert formats["fused_hnd"] == formats["fused_hnd_blocks_first"] == "NL_X_NB_NH_BS_CS"
    assert formats["fused_nhd"] == "NL_X_NB_BS_NH_CS"
    for case in res["cases"]:
        label = f"{case['case']}/{case['dtype']}"
        assert case["gather_bit_exact"], label
        assert all(case["scatter_bit_exact"].values()), (label, case["scatter_bit_exact"])
        assert case["roundtrip"], label
        assert case["untouched"], label
        # One D2H per gather (plugin side of 2 gathers + 1 re-gather), one H2D per scatter.
        assert case["plugin_calls"].get("cpu:D2H") == 2, (label, case["plugin_calls"])
        assert case["plugin_calls"].get("cpu:H2D") == 5, (label, case["plugin_calls"])
