"""What a deployment switches on in the worker: the ``layerwise`` keyword of LMCache's next
releases and the metrics mirror into prometheus_client (``kvactors.observe.mirror``), in-process
on the CPU ops; and what it does not: the harness's KV tap is not in the op."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON
from .vendors.test_lmcache_ops import CHUNK, _desc, _layers, _native, _objs, _oracle

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def _gather(ops: Any, layers: list[torch.Tensor], ids: list[int], objs: list[torch.Tensor],
            **kw: Any) -> None:  # fmt: skip
    n = _native()
    ops.multi_layer_block_kv_transfer(
        layers, objs, ids, torch.device("cpu"), n.TransferDirection.D2H, _desc(layers[0].dtype),
        CHUNK, n.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("cls", ["KvactorsCpuOps", "KvactorsMusaOps", "KvactorsMluOps"])
def test_every_plugin_takes_the_layerwise_keyword_defaulting_to_false(cls: str) -> None:
    import kvactors_lmcache.ops as ops_mod

    sig = inspect.signature(getattr(ops_mod, cls).multi_layer_block_kv_transfer)
    assert sig.parameters["layerwise"].default is False


def test_layerwise_false_is_served_bit_exact() -> None:
    from kvactors_lmcache.ops import KvactorsCpuOps

    layers, mine, want = _layers(3), _objs(2), _objs(2)
    _gather(KvactorsCpuOps(), layers, [0, 1, 2, 3], mine, layerwise=False)
    _oracle(layers, [0, 1, 2, 3], want)
    assert all(torch.equal(a, b) for a, b in zip(mine, want, strict=True))


def test_layerwise_true_is_refused_clearly_before_any_copy() -> None:
    from kvactors.errors import OperandTypeError, UnsupportedOperationError
    from kvactors_lmcache.ops import KvactorsCpuOps, transfer_counts

    ops, layers, objs = KvactorsCpuOps(), _layers(4), _objs(2, fill=-1.0)
    before = transfer_counts().get("cpu:D2H", 0)
    with pytest.raises(UnsupportedOperationError, match=r"layerwise=True.*not supported"):
        _gather(ops, layers, [0, 1, 2, 3], objs, layerwise=True)
    with pytest.raises(OperandTypeError, match="layerwise must be a bool"):
        _gather(ops, layers, [0, 1, 2, 3], objs, layerwise=1)
    assert all(bool((o == -1.0).all()) for o in objs)  # nothing copied
    assert transfer_counts().get("cpu:D2H", 0) == before


@pytest.fixture
def fresh_mirror(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A new process metrics mirror for the test (closed before and after)."""
    import kvactors.observe.mirror as mirror

    monkeypatch.delenv(mirror.ENABLE_ENV, raising=False)
    monkeypatch.setenv(mirror.INTERVAL_ENV, "3600")  # passes are the test's own
    mirror.close_process_mirror()
    yield mirror
    mirror.close_process_mirror()


@pytest.mark.timeout(60)
def test_the_workers_transfers_reach_prometheus_clients_default_registry(
    fresh_mirror: Any,
) -> None:
    from prometheus_client import REGISTRY

    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    with Runtime("cpu") as rt:
        ops = KvactorsCpuOps(runtime_factory=lambda backend, index: rt)
        layers, objs = _layers(5), _objs(2)
        _gather(ops, layers, [0, 1, 2, 3], objs)
        _gather(ops, layers, [4, 5, 6, 7], objs)
        made = fresh_mirror.process_mirror()
        assert made is not None
        made.update()
        stats = rt.statistics()

    def value(name: str, **labels: str) -> float:
        got = REGISTRY.get_sample_value(name, {"device": "cpu:0", **labels})
        assert got is not None, (name, labels)
        return float(got)

    nbytes = sum(o.numel() * o.element_size() for o in objs) * 2
    assert value("kvactors_transfers_total", result="ok") == 2
    assert value("kvactors_transfers_total", result="failed") == 0
    assert value("kvactors_bytes_moved_total") == nbytes == stats.bytes_moved
    assert value("kvactors_call_latency_seconds_count", op="transfer") == 2
    assert value("kvactors_call_latency_seconds_bucket", op="transfer", le="+Inf") == 2


def test_a_second_ops_instance_shares_the_processs_mirror(fresh_mirror: Any) -> None:
    from kvactors.runtime import Runtime
    from kvactors_lmcache.ops import KvactorsCpuOps

    with Runtime("cpu") as rt:
        assert fresh_mirror._process is None  # nothing is made before a runtime is
        KvactorsCpuOps(runtime_factory=lambda backend, index: rt)._runtime(0)
        first = fresh_mirror._process
        KvactorsCpuOps(runtime_factory=lambda backend, index: rt)._runtime(0)
        assert first is not None
        assert fresh_mirror._process is first
        assert len(first._watched) == 2


@pytest.mark.parametrize("env", [{"KVACTORS_METRICS_INTERVAL": "-1"}, {"KVACTORS_METRICS": "0"}])
def test_a_bad_or_off_metrics_setting_never_fails_a_transfer(
    fresh_mirror: Any, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    from kvactors_lmcache.ops import KvactorsCpuOps

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ops = KvactorsCpuOps()
    layers, mine, want = _layers(3), _objs(2), _objs(2)
    for _ in range(2):
        _gather(ops, layers, [0, 1, 2, 3], mine)
    _oracle(layers, [0, 1, 2, 3], want)
    assert all(torch.equal(a, b) for a, b in zip(mine, want, strict=True))
    assert fresh_mirror._process is None


def test_the_op_carries_no_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The serving tap hooks in from the harness (tools/kvactors_serving, a vLLM plugin): with
    its variable set, an op made without that plugin is the plugin's own and writes nothing."""
    from kvactors_lmcache.ops import KvactorsCpuOps

    monkeypatch.setenv("KVACTORS_SERVING_TAP", str(tmp_path))
    ops = KvactorsCpuOps()
    assert "multi_layer_block_kv_transfer" not in vars(ops)
    assert not hasattr(ops, "_kvactors_tap")
    assert list(tmp_path.iterdir()) == []
