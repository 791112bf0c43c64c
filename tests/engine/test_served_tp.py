"""Tensor parallelism under ``vllm serve``: two workers, each moving its own heads through its
own kvactors runtime (``--tensor-parallel-size 2``).

vLLM's CPU build refuses to bind the threads of two local workers automatically on a host with
one NUMA node ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); a manual
binding, one core per rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``), runs. Checks: hits, tokens and
logprob bits equal a native-prefix-caching server with the same parallelism; the tap ran in
two worker processes, each restored every hit of its own heads, bit-identical to its stores;
vLLM's own /metrics (multiprocess mode) adds up both workers' kvactors transfers.

The two TP=2 servers run one after the other: started together on two cores, their eight
processes starved the connector's heartbeat, and a PING from the connector to the LMCache server
unanswered for longer than ``lmcache.mp.heartbeat_interval`` puts the connector in degraded mode,
where lookups answer no hit. The kvactors server's heartbeat is 30 s (LMCache's default 10 s),
and a degraded connector fails the test by name, with the log lines before it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest

from . import vllm_metrics as vm
from .scenario_record import record, tap_totals
from .test_served import MAX_TOKENS, _ok, _tap_calls

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

TP = 2
TP_BIND = "0|1"  # one core per rank (vLLM's CPU syntax: ranks separated by "|")
HEARTBEAT_S = 30.0  # LMCache's server reaps a silent worker after 120 s: at least 3 heartbeats


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from kvactors_serving.api_server import ApiServer
    from kvactors_serving.model import TINY_LLAMA, make_model
    from kvactors_serving.procedure import engine_env
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.tap import TAP_ENV, read_reports
    from kvactors_serving.workload import CHUNK, make_workload

    work = tmp_path_factory.mktemp("tp")
    model = make_model("llama", work / "model", seed=0)
    wl = make_workload(seed=0, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=MAX_TOKENS)
    bind = {"VLLM_CPU_OMP_THREADS_BIND": TP_BIND}
    res: dict[str, Any] = {"wl": wl}
    prompts = (*wl.store, *wl.warm)
    with contextlib.ExitStack() as stack:
        # A request thread per rank (with one, LMCache warns, the ranks' tasks serialize).
        lmc = LMCacheServer(chunk_size=CHUNK, env=engine_env(None), max_workers=TP)
        stack.callback(lmc.stop)
        # One TP=2 server at a time: with more processes than cores a worker's forward pass
        # stalls for a minute and the connector's heartbeat goes unanswered meanwhile.
        native = ApiServer(model, env=engine_env(None) | bind, prefix_caching=True,
                           name="vllm-native-tp2", tensor_parallel_size=TP)  # fmt: skip
        stack.callback(native.stop)
        native.wait_ready()
        res["native"] = [native.complete(list(p.tokens), max_tokens=MAX_TOKENS) for p in prompts]
        native.stop()
        env = engine_env("kvactors") | bind | {TAP_ENV: str(work / "tap"),
                                               **vm.metrics_env(work / "prometheus")}  # fmt: skip
        lmc.wait_ready()
        kv = ApiServer(model, env=env, lmcache_port=lmc.port, name="vllm-kvactors-tp2",
                       tensor_parallel_size=TP, heartbeat_s=HEARTBEAT_S)  # fmt: skip
        stack.callback(kv.stop)
        kv.wait_ready()
        res["kvactors"] = [kv.complete(list(p.tokens), max_tokens=MAX_TOKENS) for p in prompts]
        res["degraded"] = _degraded_lines(kv.log(tail=None))
        res["tap"] = read_reports(work / "tap")
        calls = _tap_calls(res["tap"])  # both ranks' files, added up by vLLM's collector
        res["metrics"] = vm.wait_for(kv.port, lambda m: _ok(m) >= calls)
    record("item3-tp2", {"requests": 2 * len(res["native"]),
                         "hits": [a.hit for a in res["kvactors"][len(wl.store):]],
                         "tap": tap_totals(res["tap"])})  # fmt: skip
    return res


def _degraded_lines(log: str) -> list[str]:
    """The log's lines from each time the connector went degraded, with the three before."""
    from kvactors_serving.api_server import DEGRADED

    lines = log.splitlines()
    return ["\n".join(lines[max(0, i - 3) : i + 1]) for i, ln in enumerate(lines) if DEGRADED in ln]


@pytest.mark.timeout(900)
def test_two_tp_workers_each_move_their_heads_bit_identical_to_native(tp: dict[str, Any]) -> None:
    from kvactors_serving.workload import CHUNK

    wl = tp["wl"]
    n_store = len(wl.store)
    assert not tp["degraded"], (
        "LMCache's connector went degraded (a PING to the LMCache server unanswered in "
        f"{HEARTBEAT_S} s): its lookups answered no hit from then on:\n"
        + "\n---\n".join(tp["degraded"])
    )
    for p, n, k in zip(wl.warm, tp["native"][n_store:], tp["kvactors"][n_store:], strict=True):
        assert n.hit == k.hit == p.expected_hit, p.label
    for n, k in zip(tp["native"], tp["kvactors"], strict=True):
        assert n.bits() == k.bits()
    hits = sum(k.hit for k in tp["kvactors"][n_store:])
    reports = tp["tap"]
    assert len({r["pid"] for r in reports}) == 2  # one tapped ops instance per worker process
    for r in reports:
        assert r["chunks_restored"] * CHUNK == hits > 0  # each rank restores its heads of all
        assert r["chunks_compared"] == r["chunks_restored"]
        assert r["chunks_unknown"] == 0
        assert r["mismatches"] == []
        assert r["differential_mismatches"] == []
    # vLLM's /metrics: both workers' transfers, added up (each rank's counters in its files)
    assert _ok(tp["metrics"]) == _tap_calls(reports) > 0
    assert vm.value(tp["metrics"], "kvactors_transfers_total", result="failed") == 0
