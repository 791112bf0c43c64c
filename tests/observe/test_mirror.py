"""The prometheus_client mirror: off the call path, in one registry or multiprocess files."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from kvactors.observe import mirror as mirror_mod
from kvactors.observe.metrics import LATENCY_BUCKETS, prometheus_available
from kvactors.observe.mirror import PrometheusMirror
from kvactors.runtime import Runtime

from .test_observer import _operands, _request

pytestmark = pytest.mark.skipif(
    not prometheus_available(), reason="prometheus_client (kvactors[metrics]) not installed"
)

ROOT = Path(__file__).resolve().parents[2]


def _value(reg: Any, name: str, **labels: str) -> float | None:
    value = reg.get_sample_value(name, labels)
    return None if value is None else float(value)


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def test_transfers_reach_the_metrics_only_at_a_mirror_pass_never_per_call() -> None:
    reg = _registry()
    mirror = PrometheusMirror(registry=reg, interval=3600.0)  # the thread never passes here
    with Runtime("cpu") as rt:
        mirror.watch(rt)
        layers, objs = _operands(2)
        for _ in range(3):
            rt.transfer(_request((0, 1)), layers, objs)
        assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") is None
        mirror.update()
        nbytes = rt.statistics().bytes_moved
        assert nbytes > 0
        rt.transfer(_request((2, 3)), layers, objs)
        assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") == 3
        mirror.update()
        mirror.update()  # a pass with no change adds nothing
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") == 4
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="failed") == 0
    assert _value(reg, "kvactors_bytes_moved_total", device="cpu:0") == nbytes * 4 / 3
    lat = {"device": "cpu:0", "op": "transfer"}
    assert _value(reg, "kvactors_call_latency_seconds_count", **lat) == 4
    assert _value(reg, "kvactors_call_latency_seconds_bucket", **lat, le="+Inf") == 4
    assert (_value(reg, "kvactors_call_latency_seconds_sum", **lat) or 0.0) > 0
    mirror.stop()


def test_the_background_thread_mirrors_and_a_closed_runtime_is_read_a_last_time() -> None:
    reg = _registry()
    mirror = PrometheusMirror(registry=reg, interval=0.05)
    passes = threading.Semaphore(0)
    update = mirror.update

    def counted() -> None:
        update()
        passes.release()

    mirror.update = counted  # type: ignore[method-assign]
    with Runtime("cpu") as rt:
        mirror.watch(rt)
        layers, objs = _operands(2)
        rt.transfer(_request((0, 1)), layers, objs)
    # The runtime closed before (or after) a pass saw the transfer: the next pass reads it.
    for _ in range(2):
        assert passes.acquire(timeout=30)
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") == 1
    assert mirror._watched == []  # dropped once closed and read
    mirror.stop()


class _StubRuntime:
    """A runtime whose statistics the test sets (failures without a failing device)."""

    def __init__(self, real: Runtime) -> None:
        self.stats = real.statistics()
        self.latency = real.transfer_latency()
        self.closed = False

    def statistics(self) -> Any:
        return self.stats

    def transfer_latency(self) -> Any:
        return self.latency


def test_failures_and_bytes_are_added_as_they_grow() -> None:
    reg = _registry()
    mirror = PrometheusMirror(registry=reg, interval=3600.0)
    with Runtime("cpu") as real:
        stub = _StubRuntime(real)
    mirror.watch(stub)  # type: ignore[arg-type]
    mirror.update()
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="failed") == 0
    assert _value(reg, "kvactors_bytes_moved_total", device="cpu:0") == 0
    stub.stats = msgspec.structs.replace(stub.stats, transfers_failed=2, bytes_moved=64)
    mirror.update()
    stub.stats = msgspec.structs.replace(stub.stats, transfers_failed=5, bytes_moved=100)
    mirror.update()
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="failed") == 5
    assert _value(reg, "kvactors_bytes_moved_total", device="cpu:0") == 100
    mirror.stop()
    assert mirror._watched == []


_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from kvactors.observe import mirror
    from kvactors.runtime import Runtime
    from tests.observe.test_observer import _operands, _request

    with Runtime("cpu") as rt:
        assert mirror.watch(rt)
        layers, objs = _operands(2)
        for _ in range(int(sys.argv[2])):
            rt.transfer(_request((0, 1)), layers, objs)
    mirror.close_process_mirror()
    print(rt.statistics().bytes_moved)
    """
)


def test_in_multiprocess_mode_each_process_writes_files_a_collector_adds_up(
    tmp_path: Path,
) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVACTORS_METRICS")}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    moved = 0
    for n in (2, 3):  # two processes, as vLLM's engine core and another writer
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(ROOT), str(n)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        moved += int(out.stdout.split()[-1])
    assert sorted(p.name.split("_")[0] for p in tmp_path.iterdir()) == [
        "counter",
        "counter",
        "histogram",
        "histogram",
    ]
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") == 5
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="failed") == 0
    assert _value(reg, "kvactors_bytes_moved_total", device="cpu:0") == moved
    lat = {"device": "cpu:0", "op": "transfer"}
    assert _value(reg, "kvactors_call_latency_seconds_count", **lat) == 5
    assert _value(reg, "kvactors_call_latency_seconds_bucket", **lat, le="+Inf") == 5


@pytest.fixture
def fresh_process_mirror(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A new process-wide mirror for the test (closed before and after)."""
    monkeypatch.delenv(mirror_mod.ENABLE_ENV, raising=False)
    monkeypatch.delenv(mirror_mod.INTERVAL_ENV, raising=False)
    mirror_mod.close_process_mirror()
    yield
    mirror_mod.close_process_mirror()


@pytest.mark.usefixtures("fresh_process_mirror")
def test_the_process_mirror_registers_in_the_default_registry_once() -> None:
    from prometheus_client import REGISTRY

    with Runtime("cpu") as rt:
        assert mirror_mod.watch(rt)
        first = mirror_mod.process_mirror()
        assert first is not None
        assert mirror_mod.process_mirror() is first
        layers, objs = _operands(2)
        rt.transfer(_request((0, 1)), layers, objs)
        first.update()
    assert REGISTRY.get_sample_value(
        "kvactors_transfers_total", {"device": "cpu:0", "result": "ok"}
    )


@pytest.mark.usefixtures("fresh_process_mirror")
@pytest.mark.parametrize("raw", ["0", "-1", "nan", "soon", "4000"])
def test_a_bad_interval_turns_metrics_off_once_with_a_log_never_raises(
    raw: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(mirror_mod.INTERVAL_ENV, raw)
    with caplog.at_level(logging.WARNING, logger=mirror_mod.__name__), Runtime("cpu") as rt:
        assert not mirror_mod.watch(rt)
        assert not mirror_mod.watch(rt)
        layers, objs = _operands(2)
        rt.transfer(_request((0, 1)), layers, objs)  # transfers go on
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert mirror_mod.INTERVAL_ENV in said[0]


@pytest.mark.usefixtures("fresh_process_mirror")
def test_names_taken_in_the_registry_turn_metrics_off_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import REGISTRY, Counter

    taken = Counter("kvactors_transfers", "someone else's", ["device", "result"])
    try:
        with caplog.at_level(logging.WARNING, logger=mirror_mod.__name__), Runtime("cpu") as rt:
            assert not mirror_mod.watch(rt)
            assert not mirror_mod.watch(rt)
    finally:
        REGISTRY.unregister(taken)
    assert len(caplog.records) == 1
    assert mirror_mod._process is None


@pytest.mark.usefixtures("fresh_process_mirror")
def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mirror_mod.ENABLE_ENV, "0")
    with Runtime("cpu") as rt:
        assert not mirror_mod.watch(rt)
    assert mirror_mod._process is None


@pytest.mark.usefixtures("fresh_process_mirror")
def test_without_prometheus_client_metrics_are_off_and_transfers_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvactors.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingDependencyError, match=r"kvactors\[metrics\]"):
        PrometheusMirror()
    with Runtime("cpu") as rt:
        assert not mirror_mod.watch(rt)
        layers, objs = _operands(2)
        rt.transfer(_request((0, 1)), layers, objs)


def test_the_histogram_fallback_observes_each_call_at_its_bucket_bound() -> None:
    seen: list[float] = []

    class Plain:
        def observe(self, v: float) -> None:
            seen.append(v)

    deltas = [0] * (len(LATENCY_BUCKETS) + 1)
    deltas[0], deltas[-1] = 2, 1
    mirror_mod._add_to_histogram(Plain(), deltas, 1.0)
    bounds = LATENCY_BUCKETS
    assert seen == [bounds[0], bounds[0], bounds[-1]]


def test_a_runtime_that_cannot_be_read_is_dropped_once_logged_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = _registry()
    mirror = PrometheusMirror(registry=reg, interval=3600.0)
    with Runtime("cpu") as real:
        broken, good = _StubRuntime(real), _StubRuntime(real)

    def boom() -> Any:
        raise RuntimeError("statistics unavailable")

    broken.statistics = boom  # type: ignore[method-assign]
    mirror.watch(broken)  # type: ignore[arg-type]
    mirror.watch(good)  # type: ignore[arg-type]
    good.stats = msgspec.structs.replace(good.stats, transfers_ok=3)
    with caplog.at_level(logging.ERROR, logger=mirror_mod.__name__):
        mirror.update()
        mirror.update()
    assert mirror.errors == 1
    assert len(caplog.records) == 1
    assert [w.rt for w in mirror._watched] == [cast("Any", good)]  # the broken one dropped
    assert _value(reg, "kvactors_transfers_total", device="cpu:0", result="ok") == 3
    mirror.stop()
