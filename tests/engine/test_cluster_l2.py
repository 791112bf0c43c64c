"""A Redis Cluster as the L2 two LMCache servers share (two nodes), a master lost and back.

Runs in the engine's venv (``.venv-vllm``, where ``scripts/setup-engine.sh`` installs what
LMCache's ``valkey`` adapter needs). A 3-master Redis Cluster (Debian's ``redis-server``,
:mod:`tests.engine.redis_cluster`) and LMCache MP servers, each with
``--l2-adapter '{"type": "valkey", "cluster_mode": true, "startup_nodes": ...}'`` and kvactors'
CPU device plugin in its engines, all on 127.0.0.1; one engine process per step
(:mod:`tests.engine.engine_runs`), every process ended by the fixture's exit stack:

* engine 1 stores through server A; engine 2 through server B (another node: its own L1, it
  never saw the prompts) hits at native prefix caching's lengths, with native's tokens and
  logprob bits and the KV engine 1 stored; the keys lie on at least two masters;
* the master holding most keys is killed (SIGKILL) and marked failed: engine 3 through
  server C (its L1 empty) finishes every request within ``FAULT_BOUND_S``, with native's
  tokens (and logprob bits where the hit is native's), the chunks that master held recomputed
  (shorter hits), no kvactors failure;
* the master restarted on its ports from its directory (``nodes.conf`` and append-only file):
  engine 4 through server D (its L1 empty; up since the start, like C) hits at native
  lengths again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from typing import Any

import pytest

from .engine_runs import bits, kv_checks, poll_until, run_engine, warm
from .redis_cluster import RedisCluster
from .scenario_record import record

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

FAULT_BOUND_S = 120.0
"""The most an engine process may take (its start included) while a master is down: it is
killed past this, and the test fails."""


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvactors_serving.model import TINY_LLAMA, make_model
    from kvactors_serving.procedure import Options, _spec, engine_env
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.tap import TAP_ENV
    from kvactors_serving.workload import CHUNK, make_workload

    work = tmp_path_factory.mktemp("cluster")
    opts = Options(out=work, repeats=1)
    wl = make_workload(seed=0, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=opts.max_tokens)
    model = make_model("llama", work / "model", seed=0)
    env = engine_env("kvactors") | {TAP_ENV: str(work / "tap")}
    server_env = engine_env(None)
    res: dict[str, Any] = {"wl": wl}

    def spec(name: str, port: int, phase: str) -> dict[str, Any]:
        return _spec(opts, name, model, wl, port=port, phases=[phase])

    with contextlib.ExitStack() as stack:
        cluster = RedisCluster(work / "redis")
        stack.callback(cluster.stop)
        cluster.create()
        valkey = {"type": "valkey", "cluster_mode": True,
                  "startup_nodes": cluster.startup_nodes, "num_workers": 2}  # fmt: skip

        def server() -> Any:
            srv = LMCacheServer(chunk_size=CHUNK, env=server_env, l2_adapters=(valkey,))
            stack.callback(srv.stop)
            return srv

        # Four servers (four nodes' worth), started together while the native engine runs;
        # C and D stay idle, their L1 empty, until their engines come, so they live through the
        # master's crash (C) and its return (D) as a node's long-running server does.
        srv_a, srv_b, srv_c, srv_d = server(), server(), server(), server()
        res["native"] = run_engine(
            work, _spec(opts, "native", model, wl, prefix_caching=True,
                        phases=["store", "warm_single"]), engine_env(None),
        )  # fmt: skip
        for srv in (srv_a, srv_b, srv_c, srv_d):
            srv.wait_ready()
        res["A"] = run_engine(work, spec("A", srv_a.port, "store"), env)
        n = res["A"]["tap"]["chunks_stored"]
        res["keys"] = poll_until(
            f"keys per master (>= {n} in all)", cluster.keys_per_master, lambda k: sum(k) >= n
        )
        res["B"] = run_engine(work, spec("B", srv_b.port, "warm_single"), env)
        srv_a.stop()
        srv_b.stop()

        victim = max(range(len(cluster.ports)), key=lambda i: res["keys"][i])
        res["victim"] = victim
        cluster.kill(victim)
        cluster.wait_failed(victim)
        begin = time.monotonic()
        res["C"] = run_engine(work, spec("C", srv_c.port, "warm_single"), env,
                              timeout=FAULT_BOUND_S)  # fmt: skip
        res["C_seconds"] = time.monotonic() - begin
        srv_c.stop()

        cluster.start(victim)
        cluster.wait_ok()
        res["keys_back"] = cluster.keys_per_master()
        res["D"] = run_engine(work, spec("D", srv_d.port, "warm_single"), env)
        record("item1-cluster-l2", {
            name: {"hits": [o["hit"] for o in warm(res[name])],
                   "tap": res[name]["tap"] | {"mismatches": len(res[name]["tap"]["mismatches"])},
                   "runtime": res[name]["runtime"]}
            for name in ("B", "C", "D")
        } | {k: res[k] for k in ("keys", "keys_back", "victim", "C_seconds")})  # fmt: skip
        yield res


def _same_as_native(res: dict[str, Any], name: str) -> None:
    for p, n, o in zip(res["wl"].warm, warm(res["native"]), warm(res[name]), strict=True):
        assert o["hit"] == n["hit"] == p.expected_hit, (name, p.label)
        assert bits(o) == bits(n), (name, p.label)


@pytest.mark.timeout(900)
def test_a_server_on_another_node_hits_what_the_first_stored_in_the_cluster(
    cluster_run: dict[str, Any],
) -> None:
    assert cluster_run["A"]["tap"]["chunks_stored"] > 0
    assert sum(k > 0 for k in cluster_run["keys"]) >= 2, cluster_run["keys"]
    _same_as_native(cluster_run, "B")
    kv_checks(cluster_run["B"])
    assert cluster_run["B"]["tap"]["chunks_stored"] == 0  # B only restored what A stored


@pytest.mark.timeout(900)
def test_with_a_master_down_every_request_completes_as_native_in_bounded_time(
    cluster_run: dict[str, Any],
) -> None:
    from kvactors_serving.workload import CHUNK

    wl, native, c = cluster_run["wl"], cluster_run["native"], cluster_run["C"]
    assert cluster_run["C_seconds"] < FAULT_BOUND_S
    outs = warm(c)
    assert len(outs) == len(wl.warm)
    assert any(o["hit"] < p.expected_hit for p, o in zip(wl.warm, outs, strict=True)), (
        "the killed master held no chunk a prompt needed"
    )
    for p, n, o in zip(wl.warm, warm(native), outs, strict=True):
        assert o["hit"] <= p.expected_hit, p.label
        assert o["hit"] % CHUNK == 0, p.label  # whole chunks: the ones before the first lost one
        assert o["tokens"] == n["tokens"], p.label
        if o["hit"] == n["hit"]:
            assert bits(o) == bits(n), p.label
    assert c["runtime"]["transfers_failed"] == 0
    if any(o["hit"] for o in outs):
        kv_checks(c)


@pytest.mark.timeout(900)
def test_the_master_back_from_its_files_the_hits_come_back(cluster_run: dict[str, Any]) -> None:
    victim = cluster_run["victim"]
    assert cluster_run["keys_back"][victim] == cluster_run["keys"][victim]  # from its own files
    _same_as_native(cluster_run, "D")
    kv_checks(cluster_run["D"])
