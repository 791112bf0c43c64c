"""Metrics: statistics snapshots as samples, call timings, and optional Prometheus export.

:func:`samples` flattens a :class:`~kvactors.actors.group.DeviceStatistics` snapshot into
:class:`Sample` rows; :class:`CallMetrics` is an observer counting calls, errors and seconds
per operation (admission to settled reply); :func:`register_prometheus` exposes both through
``prometheus_client`` (``kvactors[metrics]``), read at scrape time, and :func:`render_text`
writes the text format without it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from kvactors.errors import MissingDependencyError
from kvactors.observe import observe

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvactors.actors.group import DeviceStatistics
    from kvactors.observe import Call
    from kvactors.runtime import Runtime

__all__ = (
    "CallMetrics",
    "Sample",
    "prometheus_available",
    "register_prometheus",
    "render_text",
    "samples",
    "snapshot",
)


class Sample(msgspec.Struct, frozen=True):
    """One metric value: name, kind (``counter``/``gauge``), help, labels, value."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    labels: dict[str, str]
    value: float


def snapshot(rt: Runtime) -> dict[str, Any]:
    """``rt.statistics()`` as plain builtins (JSON-ready), plus mailbox totals."""
    stats = rt.statistics()
    out: dict[str, Any] = msgspec.to_builtins(stats)
    out["mailbox_depth_total"] = sum(a.mailbox_depth for a in stats.actors)
    out["mailbox_peak_max"] = max((a.mailbox_peak for a in stats.actors), default=0)
    return out


def samples(stats: DeviceStatistics) -> list[Sample]:
    """Flatten one device snapshot into samples labelled by device (and actor)."""
    dev = {"device": stats.device}
    out = [
        Sample(
            "kvactors_bytes_moved_total",
            "counter",
            "Bytes moved by completed transfers",
            dev,
            float(stats.bytes_moved),
        ),
        Sample(
            "kvactors_transfers_total",
            "counter",
            "Transfers by result",
            {**dev, "result": "ok"},
            float(stats.transfers_ok),
        ),
        Sample(
            "kvactors_transfers_total",
            "counter",
            "Transfers by result",
            {**dev, "result": "failed"},
            float(stats.transfers_failed),
        ),
        Sample(
            "kvactors_transfers_inflight",
            "gauge",
            "Transfers not yet completed",
            dev,
            float(stats.inflight),
        ),
        Sample(
            "kvactors_ipc_owners_open",
            "gauge",
            "Opened IPC owners not yet closed",
            dev,
            float(stats.ipc_owners_open),
        ),
        Sample(
            "kvactors_ipc_owners_opened_total",
            "counter",
            "IPC owners opened",
            dev,
            float(stats.ipc_owners_opened),
        ),
        Sample(
            "kvactors_ipc_owners_closed_total",
            "counter",
            "IPC owners closed",
            dev,
            float(stats.ipc_owners_closed),
        ),
        Sample(
            "kvactors_ipc_owners_kept",
            "gauge",
            "IPC owners kept open because a stream sync before their close failed or timed out",
            dev,
            float(stats.ipc_owners_kept),
        ),
        Sample(
            "kvactors_lanes_abandoned_total",
            "counter",
            "Stream lanes whose threads did not end within the stop timeout",
            dev,
            float(stats.lanes_abandoned),
        ),
        Sample(
            "kvactors_completions_pending",
            "gauge",
            "Published completion records not drained",
            dev,
            float(stats.completions_pending),
        ),
        Sample(
            "kvactors_events_pending",
            "gauge",
            "Published event records not drained",
            dev,
            float(stats.events_pending),
        ),
        Sample(
            "kvactors_stream_syncs_total",
            "counter",
            "Stream synchronizations on lanes",
            dev,
            float(stats.stream_syncs),
        ),
        Sample(
            "kvactors_records_total",
            "counter",
            "Completion and event records by result",
            {**dev, "result": "published"},
            float(stats.records_published),
        ),
        Sample(
            "kvactors_records_total",
            "counter",
            "Completion and event records by result",
            {**dev, "result": "withdrawn"},
            float(stats.records_withdrawn),
        ),
        Sample(
            "kvactors_streams_retired_total",
            "counter",
            "Idle borrowed-stream actors retired",
            dev,
            float(stats.streams_retired),
        ),
        Sample(
            "kvactors_scratch_allocations_total",
            "counter",
            "Staging buffers and index tensors allocated for staged transfers "
            "(flat in steady state)",
            dev,
            float(stats.scratch_allocations),
        ),
        Sample(
            "kvactors_plans_validated_total",
            "counter",
            "Transfers validated (the rest reused a validated plan)",
            dev,
            float(stats.plans_validated),
        ),
        Sample(
            "kvactors_plans_rebound_total",
            "counter",
            "Transfers whose new block ids alone were validated (operands matched a plan)",
            dev,
            float(stats.plans_rebound),
        ),
        Sample(
            "kvactors_native_transfers_total",
            "counter",
            "Transfers by native kernel outcome",
            {**dev, "outcome": "moved"},
            float(stats.native_transfers),
        ),
        Sample(
            "kvactors_native_transfers_total",
            "counter",
            "Transfers by native kernel outcome",
            {**dev, "outcome": "declined"},
            float(stats.native_declined),
        ),
        Sample(
            "kvactors_stream_sync_seconds_total",
            "counter",
            "Seconds lanes spent blocked in stream synchronization",
            dev,
            float(stats.sync_wait_seconds),
        ),
    ]
    for a in stats.actors:
        lab = {**dev, "actor": a.name}
        out += [
            Sample(
                "kvactors_actor_up",
                "gauge",
                "1 when the actor is running",
                {**lab, "state": a.state},
                1.0 if a.state == "running" else 0.0,
            ),
            Sample(
                "kvactors_mailbox_depth",
                "gauge",
                "Envelopes waiting in the mailbox",
                lab,
                float(a.mailbox_depth),
            ),
            Sample(
                "kvactors_mailbox_peak",
                "gauge",
                "Highest mailbox use (queued + deferred)",
                lab,
                float(a.mailbox_peak),
            ),
            Sample("kvactors_mailbox_capacity", "gauge", "Mailbox bound", lab, float(a.capacity)),
            Sample(
                "kvactors_deferred_pending",
                "gauge",
                "Replies taken over, not yet settled",
                lab,
                float(a.deferred_pending),
            ),
            Sample(
                "kvactors_messages_processed_total",
                "counter",
                "Messages handled",
                lab,
                float(a.processed),
            ),
            Sample(
                "kvactors_messages_failed_total",
                "counter",
                "Messages whose handling failed",
                lab,
                float(a.failed),
            ),
        ]
    return out


class CallMetrics:
    """Counts, errors and seconds per operation, from mailbox admission to the settled reply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.max_seconds: dict[str, float] = {}

    def call_started(self, call: Call) -> None:
        """Observer hook (nothing to do at start)."""

    def call_finished(
        self, call: Call, seconds: float, result: Any, error: BaseException | None
    ) -> None:
        """Observer hook: account one finished call."""
        with self._lock:
            self.calls[call.op] = self.calls.get(call.op, 0) + 1
            if error is not None:
                self.errors[call.op] = self.errors.get(call.op, 0) + 1
            self.seconds[call.op] = self.seconds.get(call.op, 0.0) + seconds
            self.max_seconds[call.op] = max(self.max_seconds.get(call.op, 0.0), seconds)

    def attach(self, rt: Runtime) -> Callable[[], None]:
        """Start observing ``rt``; returns the detach function."""
        return observe(rt, self)

    def samples(self, device: str) -> list[Sample]:
        """The accumulated figures as samples."""
        out: list[Sample] = []
        with self._lock:
            for op, n in sorted(self.calls.items()):
                lab = {"device": device, "op": op}
                out += [
                    Sample(
                        "kvactors_calls_total",
                        "counter",
                        "Facade calls by operation",
                        lab,
                        float(n),
                    ),
                    Sample(
                        "kvactors_call_errors_total",
                        "counter",
                        "Facade calls that raised",
                        lab,
                        float(self.errors.get(op, 0)),
                    ),
                    Sample(
                        "kvactors_call_seconds_total",
                        "counter",
                        "Seconds callers spent in facade calls",
                        lab,
                        self.seconds[op],
                    ),
                ]
                if op in ("synchronize", "fence"):
                    out.append(
                        Sample(
                            "kvactors_sync_wait_seconds_total",
                            "counter",
                            "Seconds stream syncs and fences waited, from mailbox admission to "
                            "the reply",
                            lab,
                            self.seconds[op],
                        )
                    )
        return out


def render_text(items: list[Sample]) -> str:
    """Samples in the Prometheus text exposition format (no prometheus_client needed)."""
    lines: list[str] = []
    seen: set[str] = set()
    for s in items:
        if s.name not in seen:
            seen.add(s.name)
            lines.append(f"# HELP {s.name} {s.help}")
            lines.append(f"# TYPE {s.name} {s.kind}")
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
        lines.append(f"{s.name}{{{labels}}} {s.value!r}")
    return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_available() -> bool:
    """Whether ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class _Collector:
    """A prometheus_client custom collector reading the runtime at scrape time."""

    def __init__(self, rt: Runtime, calls: CallMetrics | None) -> None:
        self.rt = rt
        self.calls = calls

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.rt.closed:
            return
        stats = self.rt.statistics()
        items = samples(stats)
        if self.calls is not None:
            items += self.calls.samples(stats.device)
        families: dict[str, Any] = {}
        for s in items:
            fam = families.get(s.name)
            if fam is None:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                name = s.name.removesuffix("_total") if s.kind == "counter" else s.name
                fam = families[s.name] = cls(name, s.help, labels=list(s.labels))
            fam.add_metric(list(s.labels.values()), s.value)
        yield from families.values()


def register_prometheus(
    rt: Runtime, *, calls: CallMetrics | None = None, registry: Any = None, port: int | None = None
) -> Callable[[], None]:
    """Expose ``rt`` (and ``calls``) to Prometheus; returns a function that unregisters it.

    Args:
        rt: The runtime to read at each scrape.
        calls: Call timings to export as well (attach it to ``rt`` yourself).
        registry: A ``prometheus_client.CollectorRegistry`` (default: the global one).
        port: Also start ``prometheus_client``'s HTTP server on this port.

    Raises:
        MissingDependencyError: prometheus_client is not installed (an ImportError;
            ``pip install kvactors[metrics]``).
    """
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependencyError(
            "Prometheus export needs prometheus_client: pip install 'kvactors[metrics]'",
            package="prometheus_client",
        ) from exc
    reg = registry if registry is not None else prometheus_client.REGISTRY
    collector = _Collector(rt, calls)
    reg.register(collector)
    server: Any = None
    if port is not None:
        server = prometheus_client.start_http_server(port, registry=reg)

    def unregister() -> None:
        reg.unregister(collector)
        if isinstance(server, tuple):  # (httpd, thread) in prometheus_client >= 0.18
            server[0].shutdown()
            server[0].server_close()

    return unregister
