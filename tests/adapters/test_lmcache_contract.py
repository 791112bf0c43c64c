"""Contract: every public DeviceOps member of the installed lmcache is overridden or listed."""

from __future__ import annotations

import inspect

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def device_ops_cls() -> type:
    from lmcache.v1.platform.base.device_ops import DeviceOps

    return DeviceOps


def _ops_classes() -> list[type]:
    from kvactors_lmcache.ops import KvactorsCpuOps, KvactorsMluOps, KvactorsMusaOps

    return [KvactorsCpuOps, KvactorsMluOps, KvactorsMusaOps]


def _public(cls: type) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def _overridden(cls: type, base: type, name: str) -> bool:
    for klass in cls.__mro__:
        if klass is base:
            return False
        if name in vars(klass):
            return True
    return False


def test_lmcache_version_is_a_tested_one() -> None:
    import importlib.metadata
    import os

    from kvactors.cli.doctor import LMCACHE_TESTED

    installed = importlib.metadata.version("lmcache")
    assert installed in LMCACHE_TESTED
    # scripts/test.sh says which version each run is meant to test (one run per version).
    expected = os.environ.get("KVACTORS_EXPECT_LMCACHE")
    if expected:
        assert installed == expected


@pytest.mark.parametrize("ops_cls", _ops_classes() if not LMCACHE_MISSING else [])
def test_every_public_op_is_overridden_or_deliberately_inherited(
    ops_cls: type, device_ops_cls: type
) -> None:
    from kvactors_lmcache.ops import DELIBERATELY_INHERITED

    missing = [
        name
        for name in _public(device_ops_cls)
        if not _overridden(ops_cls, device_ops_cls, name) and name not in DELIBERATELY_INHERITED
    ]
    assert not missing, (
        f"{ops_cls.__name__}: neither overridden nor deliberately inherited: {missing}"
    )


def test_inherited_list_has_no_stale_entries(device_ops_cls: type) -> None:
    import importlib.metadata

    from kvactors_lmcache.ops import DELIBERATELY_INHERITED, REMOVED_IN_LMCACHE_057

    public = set(_public(device_ops_cls))
    stale = sorted(set(DELIBERATELY_INHERITED) - public - REMOVED_IN_LMCACHE_057)
    assert not stale, f"not DeviceOps members in this lmcache: {stale}"
    assert set(DELIBERATELY_INHERITED) >= REMOVED_IN_LMCACHE_057
    removed_here = importlib.metadata.version("lmcache").startswith("0.5.7")
    # The removed ops exist exactly on 0.5.6; on 0.5.7 nothing of theirs is left to inherit.
    assert removed_here == (not REMOVED_IN_LMCACHE_057 & public)
    for cls in _ops_classes():
        for name in REMOVED_IN_LMCACHE_057:
            assert hasattr(cls, name) == (not removed_here), (cls.__name__, name)
    for name, reason in DELIBERATELY_INHERITED.items():
        assert reason.strip(), name
        if name == "device_type":
            continue  # a ClassVar each subclass sets
        if name not in public:
            continue  # removed in this lmcache: nothing inherited, nothing refused (checked above)
        for cls in _ops_classes():
            refused = name in getattr(cls, "refused_ops", ())  # e.g. MLU legacy connector ops
            assert _overridden(cls, device_ops_cls, name) is refused, (cls.__name__, name)


def test_hot_surface_is_overridden(device_ops_cls: type) -> None:
    hot = [
        "multi_layer_block_kv_transfer",
        "record_completion_on_stream",
        "drain_recorded_completions",
        "record_event_on_stream",
        "drain_recorded_events",
        "tensor_from_ptr",
        "lmcache_memcpy_async",
    ]
    for cls in _ops_classes():
        for name in hot:
            assert _overridden(cls, device_ops_cls, name), (cls.__name__, name)


@pytest.mark.parametrize("ops_cls", _ops_classes() if not LMCACHE_MISSING else [])
def test_lmcache_sees_tensor_calling_convention(ops_cls: type) -> None:
    from lmcache.v1.multiprocess.transfer_context.base import (
        _detect_block_transfer_accepts_tensor,
    )

    ops = ops_cls()
    ann = (
        inspect.signature(ops.multi_layer_block_kv_transfer)
        .parameters["lmcache_objects_ptrs"]
        .annotation
    )
    assert "Tensor" in str(ann)
    assert _detect_block_transfer_accepts_tensor(ops.multi_layer_block_kv_transfer)


def test_signature_matches_lmcache(device_ops_cls: type) -> None:
    base = list(inspect.signature(device_ops_cls.multi_layer_block_kv_transfer).parameters)  # type: ignore[attr-defined]
    if "layerwise" not in base:  # LMCache's next releases add it (default False)
        base.append("layerwise")
    for cls in _ops_classes():
        assert list(inspect.signature(cls.multi_layer_block_kv_transfer).parameters) == base  # type: ignore[attr-defined]
