"""kvactors' counters as prometheus_client metrics, mirrored off the call path.

A :class:`PrometheusMirror` watches runtimes: a daemon thread reads each runtime's statistics
and transfer latency (:meth:`Runtime.transfer_latency <kvactors.runtime.Runtime.transfer_latency>`)
every ``interval`` seconds and adds what changed since its last pass to prometheus_client's own
metric types. A transfer never calls prometheus_client: its only metrics work is the
runtime's own counting, in line (no Python call).

Because these are prometheus_client's own ``Counter`` and ``Histogram``, they go wherever
prometheus_client puts them: in one process (e.g. vLLM's offline ``LLM`` API) into its default
registry, served by whatever exposes that registry; with ``PROMETHEUS_MULTIPROC_DIR`` set (in
the environment of every process, before prometheus_client is imported), into that directory's
files, which a ``MultiProcessCollector`` (vLLM's ``/metrics`` in multiprocess mode) adds up
over processes. The families, labelled by ``device`` (e.g. ``cpu:0``):

* ``kvactors_transfers_total{result="ok"|"failed"}``: transfers by result;
* ``kvactors_bytes_moved_total``: bytes moved by completed transfers;
* ``kvactors_call_latency_seconds{op="transfer"}``: the latency histogram of transfer calls
  that returned, from the call to its return, with the buckets of
  :data:`~kvactors.observe.metrics.LATENCY_BUCKETS`.

:func:`watch` is the process-wide mirror the LMCache adapter uses: ``KVACTORS_METRICS=0``
turns it off, ``KVACTORS_METRICS_INTERVAL`` sets its period in seconds (default 1). It never
raises into the caller: a missing prometheus_client, a bad setting or a name already taken in
the registry is logged once and leaves the transfers alone.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from kvactors.errors import InvalidSettingError, MissingDependencyError
from kvactors.observe.metrics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from kvactors.runtime import Runtime

__all__ = (
    "DEFAULT_INTERVAL",
    "ENABLE_ENV",
    "INTERVAL_ENV",
    "PrometheusMirror",
    "close_process_mirror",
    "process_mirror",
    "watch",
)

log = logging.getLogger(__name__)

ENABLE_ENV = "KVACTORS_METRICS"
INTERVAL_ENV = "KVACTORS_METRICS_INTERVAL"
DEFAULT_INTERVAL = 1.0
_MAX_INTERVAL = 3600.0


class _Watched:
    """One runtime and what the mirror added for it so far."""

    __slots__ = ("bytes", "closed", "failed", "latency", "ok", "rt")

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.ok = self.failed = self.bytes = 0
        self.closed = False
        #: The transfer latency already added: bucket counts, seconds.
        self.latency: tuple[tuple[int, ...], float] = ((0,) * (len(LATENCY_BUCKETS) + 1), 0.0)


class PrometheusMirror:
    """Mirrors watched runtimes into prometheus_client metrics from a background thread.

    Args:
        registry: The ``prometheus_client.CollectorRegistry`` to register the families in
            (default: prometheus_client's global one).
        interval: Seconds between two passes of the background thread (0 < interval <= 3600).

    Raises:
        MissingDependencyError: prometheus_client is not installed (``kvactors[metrics]``).
        InvalidSettingError: ``interval`` is out of range.
        ValueError: a family's name is already registered in ``registry`` (prometheus_client's
            duplicate check).
    """

    def __init__(self, *, registry: Any = None, interval: float = DEFAULT_INTERVAL) -> None:
        try:
            import prometheus_client
        except ImportError as exc:
            raise MissingDependencyError(
                "Prometheus metrics need prometheus_client: pip install 'kvactors[metrics]'",
                package="prometheus_client",
            ) from exc
        if not 0 < interval <= _MAX_INTERVAL:
            raise InvalidSettingError(
                f"the metrics interval must be in (0, {_MAX_INTERVAL:g}] seconds, got {interval!r}",
                setting="interval",
            )
        self.interval = interval
        reg = registry if registry is not None else prometheus_client.REGISTRY
        self._registry = reg
        self._transfers = prometheus_client.Counter(
            "kvactors_transfers", "Transfers by result", ["device", "result"], registry=reg
        )
        self._bytes = prometheus_client.Counter(
            "kvactors_bytes_moved", "Bytes moved by completed transfers", ["device"], registry=reg
        )
        self._latency = prometheus_client.Histogram(
            "kvactors_call_latency_seconds",
            "Latency of the calls that returned, from the call to its return",
            ["device", "op"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._lock = threading.Lock()  # the watch list
        self._pass = threading.Lock()  # one pass at a time
        self._watched: list[_Watched] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Runtimes whose statistics could not be read (the first is logged); each is dropped
        #: and the others are mirrored on.
        self.errors = 0

    def watch(self, rt: Runtime) -> None:
        """Mirror ``rt`` from now on (starts the thread once)."""
        with self._lock:
            self._watched.append(_Watched(rt))
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="kvactors-metrics-mirror", daemon=True
                )
                self._thread.start()

    def update(self) -> None:
        """One pass now: add every watched runtime's changes since the last pass.

        A runtime that closed is read a last time and then dropped, as is one whose statistics
        raise (counted in :attr:`errors`, the first logged). Never raises.
        """
        with self._lock:
            watched = list(self._watched)
        with self._pass:
            for w in watched:
                if w.closed:
                    continue
                try:
                    closed = w.rt.closed
                    self._mirror(w)
                except Exception:  # one runtime's failure must not end the others' metrics
                    self.errors += 1
                    if self.errors == 1:
                        log.exception("kvactors metrics: mirroring %s failed (logged once)", w.rt)
                    closed = True
                if closed:
                    w.closed = True
        with self._lock:
            self._watched = [w for w in self._watched if not w.closed]

    def _mirror(self, w: _Watched) -> None:
        stats = w.rt.statistics()
        dev = stats.device
        if stats.transfers_ok > w.ok:
            self._transfers.labels(dev, "ok").inc(stats.transfers_ok - w.ok)
            w.ok = stats.transfers_ok
        if stats.transfers_failed > w.failed:
            self._transfers.labels(dev, "failed").inc(stats.transfers_failed - w.failed)
            w.failed = stats.transfers_failed
        else:
            self._transfers.labels(dev, "failed")  # present (0) before the first failure
        if stats.bytes_moved > w.bytes:
            self._bytes.labels(dev).inc(stats.bytes_moved - w.bytes)
            w.bytes = stats.bytes_moved
        else:
            self._bytes.labels(dev)
        counts, seconds = w.rt.transfer_latency()
        before, before_s = w.latency
        deltas = [a - b for a, b in zip(counts, before, strict=True)]
        if any(deltas):
            _add_to_histogram(self._latency.labels(dev, "transfer"), deltas, seconds - before_s)
        w.latency = (counts, seconds)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.update()

    def stop(self) -> None:
        """A last pass, then stop the thread and forget the runtimes."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=max(5.0, 2 * self.interval))
        self.update()
        with self._lock:
            self._watched = []

    def close(self) -> None:
        """:meth:`stop`, then unregister the families from the registry (their names are
        free again for a new mirror)."""
        self.stop()
        for family in (self._transfers, self._bytes, self._latency):
            self._registry.unregister(family)


def _add_to_histogram(child: Any, deltas: list[int], seconds: float) -> None:
    """Add per-bucket counts (not cumulative; the last is +Inf) and their seconds at once.

    prometheus_client's Histogram has no public "add n observations" call; its per-bucket
    values (``_buckets``, ``_sum``, each a counter-like value that the multiprocess mode keeps
    in its files) take them. Should they be missing, each call is observed at its bucket's
    upper bound (the last finite bound for +Inf), so counts stay exact and the sum is a bound.
    """
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if isinstance(buckets, list) and len(buckets) == len(deltas) and total is not None:
        for value, n in zip(buckets, deltas, strict=True):
            if n:
                value.inc(n)
        total.inc(seconds)
        return
    for i, n in enumerate(deltas):
        bound = LATENCY_BUCKETS[min(i, len(LATENCY_BUCKETS) - 1)]
        for _ in range(n):
            child.observe(bound)


_process_lock = threading.Lock()
_process: PrometheusMirror | None = None
_process_failed = False


def _interval_from_env() -> float:
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= _MAX_INTERVAL:
        raise InvalidSettingError(
            f"{INTERVAL_ENV} must be seconds in (0, {_MAX_INTERVAL:g}], got {raw!r}",
            setting=INTERVAL_ENV,
        )
    return value


def process_mirror() -> PrometheusMirror | None:
    """This process's mirror into prometheus_client's default registry, made once.

    None when ``KVACTORS_METRICS`` is ``0``/``false``/``no``/``off``, or when it could not be
    made (prometheus_client missing, a bad ``KVACTORS_METRICS_INTERVAL``, the names taken):
    that is logged once, at the first call, and never raised.
    """
    global _process, _process_failed
    if os.environ.get(ENABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _process_lock:
        if _process is None and not _process_failed:
            try:
                _process = PrometheusMirror(interval=_interval_from_env())
            except (ImportError, InvalidSettingError, ValueError) as exc:
                _process_failed = True
                log.warning(
                    "kvactors metrics are off in this process: %s (transfers are not affected)",
                    exc,
                )
        return _process


def close_process_mirror() -> None:
    """Close this process's mirror (:meth:`PrometheusMirror.close`) and forget it and any
    failure to make it: the next :func:`watch` makes a new one."""
    global _process, _process_failed
    with _process_lock:
        made, _process, _process_failed = _process, None, False
    if made is not None:
        made.close()


def watch(rt: Runtime) -> bool:
    """Mirror ``rt`` through :func:`process_mirror`; whether it is mirrored (a stand-in that
    is no :class:`~kvactors.runtime.Runtime` is not). Never raises."""
    from kvactors.runtime import Runtime

    if not isinstance(rt, Runtime):
        return False
    mirror = process_mirror()
    if mirror is None:
        return False
    try:
        mirror.watch(rt)
    except Exception as exc:  # metrics must never fail the caller's transfer path
        log.warning("kvactors metrics: cannot watch %s: %s", rt, exc)
        return False
    return True
