"""Metrics: statistics snapshots as samples, call timings, and optional Prometheus export.

:func:`samples` flattens a :class:`~kvactors.actors.group.DeviceStatistics` snapshot into
:class:`Sample` rows; :class:`CallMetrics` is an observer counting calls, errors and seconds
per operation (admission to settled reply); :func:`register_prometheus` exposes both through
``prometheus_client`` (``kvactors[metrics]``), read at scrape time in the process that serves
the registry, and :func:`render_text` writes the text format without it. To reach a server's
own ``/metrics`` (vLLM's, also in its multiprocess mode), use :mod:`kvactors.observe.mirror`.

Actor labels never carry a stream handle (a borrowed stream's handle is the caller's native
queue pointer): stream actors are labelled ``stream:<kind>:<index>:default`` (handle 0) or
``...:borrowed`` (every caller stream, summed).
"""

from __future__ import annotations

import bisect
import threading
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from kvactors.errors import MissingDependencyError
from kvactors.observe import observe
from kvactors.runtime import LATENCY_BOUNDS

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from kvactors.actors.actor import ActorStatistics
    from kvactors.actors.group import DeviceStatistics
    from kvactors.observe import Call
    from kvactors.runtime import Runtime

__all__ = (
    "LATENCY_BUCKETS",
    "CallMetrics",
    "Sample",
    "prometheus_available",
    "register_prometheus",
    "render_text",
    "actor_label",
    "samples",
    "snapshot",
)

LATENCY_BUCKETS: tuple[float, ...] = LATENCY_BOUNDS
"""Upper bounds (seconds) of :class:`CallMetrics`' per-call latency histogram (the runtime's
own transfer latency has the same)."""


class Sample(msgspec.Struct, frozen=True):
    """One metric value: name, kind (``counter``/``gauge``/``histogram``), help, labels, value.

    A histogram is written as its ``_bucket`` (label ``le``), ``_sum`` and ``_count`` samples,
    each with kind ``histogram``.
    """

    name: str
    kind: Literal["counter", "gauge", "histogram"]
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


def actor_label(name: str) -> str:
    """An actor's name as a metric label: a stream actor's handle becomes ``default`` (0) or
    ``borrowed`` (a caller's stream; its handle is a native pointer and never leaves the
    process); other names are kept."""
    kind, sep, rest = name.partition(":")
    if kind != "stream" or not sep:
        return name
    head, _, handle = rest.rpartition(":")
    if not head:
        return name
    try:
        value = int(handle, 0)
    except ValueError:
        return f"stream:{head}:borrowed"
    return f"stream:{head}:{'default' if value == 0 else 'borrowed'}"


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
    groups: dict[str, list[ActorStatistics]] = {}
    for a in stats.actors:
        groups.setdefault(actor_label(a.name), []).append(a)
    for name, group in groups.items():
        lab = {**dev, "actor": name}
        for state in sorted({a.state for a in group}):
            running = sum(1 for a in group if a.state == state == "running")
            out.append(
                Sample(
                    "kvactors_actor_up",
                    "gauge",
                    "Running actors (1 per actor; borrowed streams summed)",
                    {**lab, "state": state},
                    float(running),
                )
            )
        out += [
            Sample(
                "kvactors_mailbox_depth",
                "gauge",
                "Envelopes waiting in the mailbox",
                lab,
                float(sum(a.mailbox_depth for a in group)),
            ),
            Sample(
                "kvactors_mailbox_peak",
                "gauge",
                "Highest mailbox use (queued + deferred)",
                lab,
                float(max(a.mailbox_peak for a in group)),
            ),
            Sample(
                "kvactors_mailbox_capacity",
                "gauge",
                "Mailbox bound",
                lab,
                float(max(a.capacity for a in group)),
            ),
            Sample(
                "kvactors_deferred_pending",
                "gauge",
                "Replies taken over, not yet settled",
                lab,
                float(sum(a.deferred_pending for a in group)),
            ),
            Sample(
                "kvactors_messages_processed_total",
                "counter",
                "Messages handled",
                lab,
                float(sum(a.processed for a in group)),
            ),
            Sample(
                "kvactors_messages_failed_total",
                "counter",
                "Messages whose handling failed",
                lab,
                float(sum(a.failed for a in group)),
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
        #: Per operation, calls per latency bucket (LATENCY_BUCKETS, then +Inf), not cumulative.
        self.buckets: dict[str, list[int]] = {}

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
            counts = self.buckets.get(call.op)
            if counts is None:
                counts = self.buckets[call.op] = [0] * (len(LATENCY_BUCKETS) + 1)
            counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

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
                out += self._histogram(op, lab)
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

    def _histogram(self, op: str, lab: dict[str, str]) -> list[Sample]:
        # Called with the lock held.
        name, what = "kvactors_call_latency_seconds", "Per-call latency of facade calls"
        out: list[Sample] = []
        total = 0
        bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
        for le, n in zip(bounds, self.buckets.get(op, []), strict=True):
            total += n
            out.append(Sample(f"{name}_bucket", "histogram", what, lab | {"le": le}, float(total)))
        out.append(Sample(f"{name}_sum", "histogram", what, lab, self.seconds[op]))
        out.append(Sample(f"{name}_count", "histogram", what, lab, float(total)))
        return out


def _family(s: Sample) -> str:
    if s.kind != "histogram":
        return s.name
    for suffix in ("_bucket", "_sum", "_count"):
        if s.name.endswith(suffix):
            return s.name.removesuffix(suffix)
    return s.name


def render_text(items: list[Sample]) -> str:
    """Samples in the Prometheus text exposition format (no prometheus_client needed)."""
    lines: list[str] = []
    seen: set[str] = set()
    for s in items:
        family = _family(s)
        if family not in seen:
            seen.add(family)
            lines.append(f"# HELP {family} {s.help}")
            lines.append(f"# TYPE {family} {s.kind}")
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
            if s.kind == "histogram":  # in serve_http's text; not rebuilt for prometheus_client
                continue
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

    Read at scrape time, so only a registry this process serves sees it (a multiprocess
    collector never does: use :mod:`kvactors.observe.mirror` there). Use one of the two per
    registry: both write ``kvactors_transfers_total`` and ``kvactors_bytes_moved_total``.

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
