"""The worker's metrics endpoint: kvactors' statistics of a running server, on loopback.

``KVACTORS_METRICS_PORT=PORT`` (in the environment of the process LMCache makes the kvactors
ops in: vLLM's worker, the engine-core process under ``vllm serve``) starts one HTTP server per
process at ``http://127.0.0.1:PORT/metrics`` when the ops make their first runtime (at the first
transfer: LMCache makes the ops in every process that imports it, the API server's too, and only
the worker moves KV; a port that cannot be bound fails that transfer, loudly). Every runtime
those ops create is watched: its statistics (transfers, bytes, failures, mailboxes) are read at
scrape time and a :class:`~kvactors.observe.metrics.CallMetrics` observer adds per-call counts,
errors and the latency histogram. ``KVACTORS_METRICS_HOST`` may name another loopback address.
With tensor parallelism every worker process needs its own port: ``PORT`` is the first, worker
``rank`` (``LOCAL_RANK``, else its ``torch.distributed`` rank) listens on ``PORT + rank``.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from kvactors.errors import InvalidSettingError
from kvactors.observe.metrics import CallMetrics, Sample, samples, serve_http

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvactors.runtime import Runtime

__all__ = ("METRICS_ENV", "MetricsEndpoint", "start_from_env")

METRICS_ENV = "KVACTORS_METRICS_PORT"
HOST_ENV = "KVACTORS_METRICS_HOST"

_lock = threading.Lock()
_endpoint: MetricsEndpoint | None = None


class MetricsEndpoint:
    """The runtimes of this process and their call metrics, served by one HTTP server."""

    def __init__(self, *, port: int, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._watched: list[tuple[Runtime, CallMetrics, Callable[[], None]]] = []
        self.port, self._stop = serve_http(self.collect, port=port, host=host)
        self.host = host

    def watch(self, rt: Runtime) -> None:
        """Export ``rt`` (its statistics and a call observer attached now)."""
        calls = CallMetrics()
        detach = calls.attach(rt)
        with self._lock:
            self._watched.append((rt, calls, detach))

    def collect(self) -> list[Sample]:
        """One scrape: every watched, still open runtime."""
        with self._lock:
            watched = list(self._watched)
        out: list[Sample] = []
        for rt, calls, _ in watched:
            if rt.closed:
                continue
            stats = rt.statistics()
            out += samples(stats)
            out += calls.samples(stats.device)
        return out

    def stop(self) -> None:
        """Stop serving and detach the observers."""
        self._stop()
        with self._lock:
            watched, self._watched = self._watched, []
        for _, _, detach in watched:
            detach()


def _port_from_env(raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise InvalidSettingError(
            f"{METRICS_ENV} must be a TCP port (1-65535), got {raw!r}", setting=METRICS_ENV
        )
    return port + _local_rank()


def _local_rank() -> int:
    """``LOCAL_RANK``, else this process's ``torch.distributed`` rank (vLLM's multiprocessing
    executor initializes it in every worker before the first transfer and sets no variable),
    else 0."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if raw.isdigit():
        return int(raw)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def start_from_env() -> MetricsEndpoint | None:
    """This process's endpoint when ``KVACTORS_METRICS_PORT`` is set (started once), else None.

    Raises:
        InvalidSettingError: the port or host is not valid (before anything is started).
    """
    global _endpoint
    raw = os.environ.get(METRICS_ENV, "").strip()
    if not raw:
        return None
    with _lock:
        if _endpoint is None:
            host = os.environ.get(HOST_ENV, "").strip() or "127.0.0.1"
            _endpoint = MetricsEndpoint(port=_port_from_env(raw), host=host)
        return _endpoint
