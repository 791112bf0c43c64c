"""The DeviceSpec plugins: names, discovery, availability gates, handle-path gates."""

from __future__ import annotations

import importlib.metadata

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON, lmcache_env, run_script

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

EXPECTED = {
    "kvactors_mlu": ("KvactorsMluSpec", "mlu", "mlu"),
    "kvactors_musa": ("KvactorsMusaSpec", "musa", "musa"),
    "kvactors_cpu": ("KvactorsCpuSpec", "cpu", "cpu"),
}


def test_entry_points_name_equals_backend_name() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="lmcache.device_plugins")}
    for name, (cls_name, device_type, torch_mod) in EXPECTED.items():
        assert name in eps, f"entry point {name!r} missing (reinstall: pip install -e .)"
        cls = eps[name].load()
        assert cls.__name__ == cls_name
        spec = cls()
        assert spec.backend_name == name
        assert spec.device_type == device_type
        assert spec.torch_module_name == torch_mod


def test_lmcache_loads_all_three_plugins() -> None:
    from lmcache.v1.platform._device_detect import _load_external_device_specs

    names = {spec.backend_name for spec in _load_external_device_specs()}
    assert set(EXPECTED) <= names


def test_spec_module_imports_nothing_device_specific() -> None:
    import ast
    from pathlib import Path

    import kvactors_lmcache.spec as spec_mod

    tree = ast.parse(Path(spec_mod.__file__).read_text())
    top: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.append(node.module or "")
        elif isinstance(node, ast.Import):
            top.extend(a.name for a in node.names)
    allowed = (
        "__future__",
        "logging",
        "os",
        "threading",
        "typing",
        "lmcache.v1.platform.base.",
        "lmcache.v1.multiprocess.transfer_mode",
        "kvactors.core.plugins",
    )
    assert all(m.startswith(allowed) for m in top), top


def test_defaults_engine_driven_and_handle_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache.v1.multiprocess.transfer_mode import MPTransferMode

    from kvactors_lmcache.spec import KvactorsCpuSpec, KvactorsMluSpec, KvactorsMusaSpec

    monkeypatch.delenv("LMCACHE_MUSA_HANDLE_TRANSFER", raising=False)
    for cls in (KvactorsMluSpec, KvactorsMusaSpec, KvactorsCpuSpec):
        spec = cls()
        assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
        assert spec.is_lmcache_driven_available() is False
        assert spec.ipc_wrapper_cls is None
        assert spec.event_ipc_backend is None
        with pytest.raises(NotImplementedError):
            spec.create_cache_context()


def test_musa_handle_opt_in_without_torch_musa_stays_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvactors_lmcache.spec import KvactorsMusaSpec

    monkeypatch.setenv("LMCACHE_MUSA_HANDLE_TRANSFER", "1")
    spec = KvactorsMusaSpec()
    assert spec.is_lmcache_driven_available() is False
    assert spec.ipc_wrapper_cls is None
    with pytest.raises(NotImplementedError, match="LMCACHE_MUSA_HANDLE_TRANSFER"):
        spec.create_cache_context()


def test_cpu_spec_is_env_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvactors_lmcache.spec import KvactorsCpuSpec

    monkeypatch.delenv("KVACTORS_LMCACHE_CPU", raising=False)
    assert KvactorsCpuSpec().is_available() is False
    monkeypatch.setenv("KVACTORS_LMCACHE_CPU", "0")
    assert KvactorsCpuSpec().is_available() is False
    monkeypatch.setenv("KVACTORS_LMCACHE_CPU", "1")
    assert KvactorsCpuSpec().is_available() is True


def test_accelerator_specs_unavailable_here_and_never_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvactors.devices as devices
    from kvactors_lmcache.spec import KvactorsMluSpec, KvactorsMusaSpec

    assert KvactorsMluSpec().is_available() is False
    assert KvactorsMusaSpec().is_available() is False

    def boom(kind: str) -> object:
        raise RuntimeError(f"driver exploded probing {kind}")

    monkeypatch.setattr(devices, "get_backend", boom, raising=False)
    assert KvactorsMluSpec().is_available() is False
    assert KvactorsMusaSpec().is_available() is False


def test_stream_handle_is_native_int() -> None:
    from kvactors_lmcache.spec import KvactorsMluSpec

    class S:
        mlu_stream = 0x1234

    assert KvactorsMluSpec().get_stream_handle(S()) == 0x1234
    with pytest.raises(RuntimeError, match="no integer native handle"):
        KvactorsMluSpec().get_stream_handle(object())


def test_cpu_plugin_selection_in_fresh_process() -> None:
    """KVACTORS_LMCACHE_CPU=1: auto-selected; unset: LMCache's stub CPU stays in charge."""
    code = "detect_selection.py"
    on = run_script(code, env=lmcache_env(KVACTORS_LMCACHE_CPU="1"))
    assert on["ops"] == "kvactors_lmcache.ops.KvactorsCpuOps"
    assert on["device_ops"] == "kvactors_lmcache.ops.KvactorsCpuOps"
    assert on["torch_dev"] == "torch.cpu"
    assert on["spec"] == "kvactors_cpu"
    off = run_script(code, env=lmcache_env())
    assert off["ops"] == "lmcache.v1.platform.devices.cpu.device_ops.CpuDeviceOps"
    assert off["spec"] != "kvactors_cpu"


def test_accelerator_specs_step_aside_unless_unambiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Available only if selected by name or the only backend LMCache registered for the type.

    The device probe is forced on, so only the coexistence rule decides; the registry is
    LMCache's own (whatever this LMCache version registers).
    """
    import kvactors_lmcache.spec as spec_mod
    from kvactors_lmcache.spec import KvactorsMluSpec, KvactorsMusaSpec, registered_backends

    monkeypatch.setattr(spec_mod, "probe_backend", lambda kind: (True, ""))
    monkeypatch.delenv("LMCACHE_DEVICE_BACKEND", raising=False)
    musa = registered_backends("musa")
    assert musa is not None
    assert "musa" in musa  # LMCache's built-in, on every version
    assert "kvactors_musa" in musa
    assert KvactorsMusaSpec().is_available() is False
    mlu = registered_backends("mlu")
    assert mlu is not None
    assert "kvactors_mlu" in mlu
    assert KvactorsMluSpec().is_available() is (mlu == ("kvactors_mlu",))
    for cls, name, sole in (
        (KvactorsMusaSpec, "kvactors_musa", False),
        (KvactorsMluSpec, "kvactors_mlu", mlu == ("kvactors_mlu",)),
    ):
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", f" {name.upper()} ")
        assert cls().is_available() is True
        monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "musa")  # another backend selected
        assert cls().is_available() is sole
    # An unreadable registry fails closed: kvactors then runs only when selected by name.
    monkeypatch.delenv("LMCACHE_DEVICE_BACKEND")
    monkeypatch.setattr(spec_mod, "registered_backends", lambda device_type: None)
    assert KvactorsMluSpec().is_available() is False
