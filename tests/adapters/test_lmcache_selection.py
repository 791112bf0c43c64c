"""Backend selection with kvactors' fake vendor modules, and the failure without them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from .conftest import LMCACHE_MISSING, SCRIPTS, SKIP_REASON, lmcache_env, run_script

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

CASES = [("mlu", "mlu", "KvactorsMluOps"), ("musa", "kvactors_musa", "KvactorsMusaOps")]


def _backend_missing(kind: str) -> bool:
    return importlib.util.find_spec(f"kvactors.devices.{kind}") is None


@pytest.mark.parametrize(("kind", "backend", "ops"), CASES)
def test_fake_vendor_selects_plugin_and_transfers(kind: str, backend: str, ops: str) -> None:
    # fake_selection moves real NHD (format 1) memory: on MLU that must be declared resolved.
    env = lmcache_env(LMCACHE_DEVICE_BACKEND=backend, KVACTORS_MLU_LAYOUT_SOURCE="resolved")
    res = run_script("fake_selection.py", kind, env=env)
    assert res["torch_device_type"] == kind
    assert res["spec"] == backend
    assert res["ops"] == f"kvactors_lmcache.ops.{ops}"
    assert res["global_ops"] == ops
    assert res["d2h_bit_exact"]
    assert res["h2d_bit_exact"]
    assert str(res["pointer_mode"]).startswith("TypeError: kvactors adapter"), res


@pytest.mark.parametrize(("kind", "backend", "ops"), CASES)
def test_explicit_backend_without_vendor_module_fails_clearly(
    kind: str, backend: str, ops: str
) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "detect_selection.py")],
        env=lmcache_env(LMCACHE_DEVICE_BACKEND=backend),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert f"LMCACHE_DEVICE_BACKEND='{backend}' is registered but not available" in err
    assert f"kvactors LMCache plugin '{backend}' is unavailable" in err
