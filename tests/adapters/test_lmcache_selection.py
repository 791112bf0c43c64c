"""Backend selection under kvactors' fake vendor modules, in fresh processes (LMCache's own code).

Coexistence (design.md, "Adapter"): with kvactors installed and no ``LMCACHE_DEVICE_BACKEND``,
importing LMCache never raises and LMCache selects what it selects without kvactors, except
where LMCache has no backend at all for the device type (MLU on 0.5.6), where kvactors' plugin
is the only one. Selecting a kvactors plugin by name works on every LMCache version, and a
transfer through it is bit-exact against LMCache's torch path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import LMCACHE_MISSING, SCRIPTS, SKIP_REASON, lmcache_env, run_script

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

CASES = [("mlu", "kvactors_mlu", "KvactorsMluOps"), ("musa", "kvactors_musa", "KvactorsMusaOps")]


@pytest.mark.parametrize(
    ("kind", "device_type_env"), [("mlu", False), ("musa", False), ("musa", True)]
)
def test_installing_kvactors_never_changes_or_breaks_lmcaches_choice(
    kind: str, device_type_env: bool
) -> None:
    env = lmcache_env(**({"DEVICE_TYPE": kind} if device_type_env else {}))
    with_kv = run_script("lmcache_selects.py", "--fake", kind, env=env)
    without = run_script("lmcache_selects.py", "--fake", kind, "--hide-kvactors", env=env)
    assert with_kv["error"] is None, with_kv  # import lmcache(.v1.platform) did not raise
    assert without["error"] is None, without
    others = [b for b in with_kv["registry"][kind] if not b.startswith("kvactors_")]
    if others:
        # LMCache has its own backend for this device: it keeps choosing exactly that.
        assert with_kv["backend"] == without["backend"]
        assert with_kv["backend"] in others
    else:
        # No LMCache backend for the type (MLU on 0.5.6): kvactors' plugin is the only one.
        assert without["backend"] is None
        assert with_kv["backend"] == f"kvactors_{kind}"
    assert with_kv["device_type"] == kind


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
