"""End to end: LMCache's MP server + LMCache's own engine-driven client, kvactors doing copies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON, lmcache_env, run_script

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def _inline_context() -> str:
    """The non-SHM engine-driven transport this LMCache offers (0.5.6 pickle, 0.5.7 msgspec)."""
    pkg = "lmcache.v1.multiprocess.transfer_context"
    if importlib.util.find_spec(f"{pkg}.inline") is not None:
        return "EngineDrivenContextInline"  # 0.5.7: inline msgspec tensor_wire, no pickle
    assert importlib.util.find_spec(f"{pkg}.pickle") is not None
    return "EngineDrivenContextPickle"  # 0.5.6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_store_lookup_retrieve_round_trip(transport: str, lmcache_server_factory) -> None:
    # The server runs without the plugin (LMCache's stub CPU): on the engine-driven path it
    # only handles host chunks; every copy happens in the client, through kvactors.
    srv = lmcache_server_factory(shm=transport == "shm", env=lmcache_env())
    try:
        res = run_script(
            "e2e_client.py",
            str(srv.port),
            transport,
            env=lmcache_env(KVACTORS_LMCACHE_CPU="1"),
            timeout=150,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- server log\n{srv.log()}") from None
    assert res["ops_module"] == "kvactors_lmcache.ops"
    assert res["ops_type"] == "KvactorsCpuOps"
    expected_sub = "EngineDrivenContextShm" if transport == "shm" else _inline_context()
    assert {c["case"] for c in res["cases"]} == {"nhd", "mla", "sglang", "fused"}
    for case in res["cases"]:
        assert case["ctx"] == "EngineDrivenTransferContext", case
        assert case["sub_ctx"] == expected_sub, case
        assert case["stored"], case
        for skip, r in case["retrieves"].items():
            label = (case["case"], transport, skip)
            assert r["hit_chunks"] == r["expected_chunks"], label
            assert r["retrieved"], label
            assert r["bit_exact"], label
    # Served by kvactors: one gather per store, one scatter per retrieve, per case.
    assert res["plugin_calls"] == {"cpu:D2H": 4, "cpu:H2D": 12}

    rc = srv.stop()
    assert rc in (0, -15), f"server exit code {rc}\n{srv.log()}"
    assert srv.leftover == [], f"leftover server children {srv.leftover}"
    if srv.shm_name:
        assert not Path("/dev/shm", srv.shm_name).exists(), "SHM segment left behind"
        assert not [p for p in Path("/dev/shm").iterdir() if srv.shm_name in p.name]
