"""Metrics: snapshots, samples, call timings, Prometheus with and without prometheus_client."""

from __future__ import annotations

import sys

import msgspec
import pytest

from kvactors.observe.metrics import (
    CallMetrics,
    actor_label,
    prometheus_available,
    register_prometheus,
    render_text,
    samples,
    snapshot,
)
from kvactors.runtime import Runtime


def test_snapshot_and_samples() -> None:
    with Runtime("cpu") as rt:
        calls = CallMetrics()
        detach = calls.attach(rt)
        rt.ping()
        rt.synchronize()
        rt.fence([1, 2])
        snap = snapshot(rt)
        stats = rt.statistics()
        detach()
    assert snap["device"] == "cpu:0"
    assert snap["mailbox_depth_total"] == 0
    names = {s.name for s in samples(stats)}
    assert {
        "kvactors_bytes_moved_total",
        "kvactors_transfers_total",
        "kvactors_mailbox_depth",
        "kvactors_actor_up",
    } <= names
    assert calls.calls == {"ping": 1, "synchronize": 1, "fence": 1}
    text = render_text(samples(stats) + calls.samples("cpu:0"))
    assert "# TYPE kvactors_bytes_moved_total counter" in text
    assert 'kvactors_sync_wait_seconds_total{device="cpu:0",op="fence"}' in text
    assert 'kvactors_mailbox_depth{device="cpu:0",actor="gather:cpu:0"} 0.0' in text


@pytest.mark.skipif(not prometheus_available(), reason="prometheus_client not installed")
def test_prometheus_collector() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    with Runtime("cpu") as rt:
        calls = CallMetrics()
        calls.attach(rt)
        unregister = register_prometheus(rt, calls=calls, registry=reg)
        rt.synchronize()
        text = generate_latest(reg).decode()
        unregister()
    assert 'kvactors_bytes_moved_total{device="cpu:0"} 0.0' in text
    assert 'kvactors_transfers_total{device="cpu:0",result="failed"} 0.0' in text
    assert "kvactors_sync_wait_seconds_total" in text
    assert "kvactors_mailbox_capacity" in text


def test_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert not prometheus_available()
    with Runtime("cpu") as rt:
        with pytest.raises(ImportError, match=r"kvactors\[metrics\]"):
            register_prometheus(rt)
        assert "kvactors_transfers_total" in render_text(samples(rt.statistics()))


def test_no_sample_carries_a_stream_handle_borrowed_streams_are_summed() -> None:
    with Runtime("cpu") as rt:
        stats = rt.statistics()
    (stream,) = [a for a in stats.actors if a.name.startswith("stream:")]
    borrowed = [
        msgspec.structs.replace(stream, name=f"stream:mlu:0:{h:#x}", processed=n, mailbox_peak=n)
        for h, n in ((0x7F7FBA000080, 3), (0x7F7FBA000100, 4))
    ]
    default = msgspec.structs.replace(stream, name="stream:mlu:0:0x0", processed=1)
    stats = msgspec.structs.replace(stats, actors=(*stats.actors, *borrowed, default))
    items = samples(stats)
    text = render_text(items)
    assert "0x" not in text
    got = {
        s.labels["actor"]: s.value for s in items if s.name == "kvactors_messages_processed_total"
    }
    assert got["stream:mlu:0:borrowed"] == 7
    assert got["stream:mlu:0:default"] == 1
    peak = [s for s in items if s.name == "kvactors_mailbox_peak"]
    assert max(s.value for s in peak if s.labels["actor"] == "stream:mlu:0:borrowed") == 4
    up = [s for s in items if s.name == "kvactors_actor_up"]
    assert {s.labels["actor"]: s.value for s in up}["stream:mlu:0:borrowed"] == 2
    assert actor_label("stream:cpu:0:0x0") == "stream:cpu:0:default"
    assert actor_label("gather:cpu:0") == "gather:cpu:0"
