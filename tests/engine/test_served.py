"""``vllm serve`` as operators run it: the OpenAI server, multiprocessing on, no user code.

Runs in the engine's venv (``.venv-vllm``; ``scripts/test.sh``'s engine phase). Everything on
127.0.0.1, started here and stopped by the fixtures' exit stacks (SIGTERM, then SIGKILL of the
process group: only processes these tests started).

* Item 1: a native-prefix-caching server and a server with LMCache's MP connector and the
  ``kvactors_cpu`` plugin, the KV tap (``KVACTORS_SERVING_TAP``) switched on in its
  engine-core process by the environment alone, and vLLM's multiprocess metrics
  (``PROMETHEUS_MULTIPROC_DIR``): store prompts then warm prompts one at a time, hits, tokens
  and logprob bits equal; every restored chunk bit-identical to what was stored; then a bounded
  concurrent load (shared prefixes, 8 in flight, a KV cache small enough that vLLM preempts)
  with zero failures, every restore bit-identical, and vLLM's own /metrics scraped during it:
  every kvactors family there moves as the tap counts.
* Item 2: kvactors against LMCache's own CPU op, each behind its own ``vllm serve`` and LMCache
  server, load rounds alternated (ABBA): zero failures on both, kvactors served every retrieve
  (the bytes in vLLM's /metrics cover LMCache's hits), TTFT and requests/s written to
  ``served-load.json`` (speed is reported, never asserted: docs/deployment.md has the figures).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from . import vllm_metrics as vm
from .scenario_record import RESULTS_ENV, record, tap_totals

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

MAX_TOKENS = 8
LOAD_TOKENS = 24  # generated per request under load: running requests grow into new blocks
IN_FLIGHT = 8
LOAD_BLOCKS = 24  # the loaded servers' KV cache (blocks of 32 tokens): 8 requests outgrow it
LOAD_LEN = 512  # their max_model_len (the longest load prompt and its tokens: 440)
LOAD_ROUNDS = 4  # per side in item 2, ABBA


def _ok(m: dict[vm.Key, float]) -> float:
    return vm.value(m, "kvactors_transfers_total", result="ok")


def _tap_calls(reports: list[dict[str, Any]]) -> int:
    return sum(r["op_calls"]["store"] + r["op_calls"]["retrieve"] for r in reports)


def _vllm_preemptions(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


def _same_or_near_tie(a: Any, b: Any) -> bool:
    from kvactors_serving.procedure import NEAR_TIE

    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)):
        if x != y:
            margins = [float.fromhex(t[0]) - float.fromhex(t[1]) for t in (a.top2[i], b.top2[i])]
            return min(margins) < NEAR_TIE
    return True


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvactors_serving.model import make_model

    return make_model("llama", tmp_path_factory.mktemp("model") / "llama", seed=0)


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Item 1's run: both servers, the one-at-a-time phases, the tapped load with scrapes."""
    from kvactors_serving.api_server import ApiServer
    from kvactors_serving.load import load_prompts, run_load
    from kvactors_serving.model import TINY_LLAMA
    from kvactors_serving.procedure import engine_env
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.tap import TAP_ENV
    from kvactors_serving.workload import CHUNK, make_workload

    tap_dir = tmp_path_factory.mktemp("tap")
    wl = make_workload(seed=0, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=MAX_TOKENS)
    with contextlib.ExitStack() as stack:
        lmc = LMCacheServer(chunk_size=CHUNK, env=engine_env(None))
        stack.callback(lmc.stop)
        native = ApiServer(model, env=engine_env(None), prefix_caching=True, name="vllm-native")
        stack.callback(native.stop)
        prom = vm.metrics_env(tmp_path_factory.mktemp("prometheus-multiproc"))
        env = engine_env("kvactors") | {TAP_ENV: str(tap_dir)} | prom
        lmc.wait_ready()
        kv = ApiServer(
            model, env=env, lmcache_port=lmc.port, name="vllm-kvactors", num_blocks=LOAD_BLOCKS,
            max_model_len=LOAD_LEN,
        )  # fmt: skip
        stack.callback(kv.stop)
        native.wait_ready()
        kv.wait_ready()
        res: dict[str, Any] = {"wl": wl, "tap_dir": tap_dir, "server_pid": kv.proc.pid}
        for name, srv in (("native", native), ("kvactors", kv)):
            res[name] = {
                "store": [srv.complete(list(p.tokens), max_tokens=MAX_TOKENS) for p in wl.store],
                "warm": [srv.complete(list(p.tokens), max_tokens=MAX_TOKENS) for p in wl.warm],
            }
        native.stop()
        from kvactors_serving.tap import read_reports

        res["tap_single"] = read_reports(tap_dir)
        calls = _tap_calls(res["tap_single"])
        res["metrics_before"] = vm.wait_for(kv.port, lambda m: _ok(m) >= calls)
        scrapes: list[dict[vm.Key, float]] = []
        done = threading.Event()

        def scraper() -> None:
            while not done.wait(0.5):  # a scrape every half second while the load runs
                scrapes.append(vm.scrape(kv.port))

        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        prompts = load_prompts(seed=101, vocab=int(TINY_LLAMA["vocab_size"]), chunk=CHUNK)
        prompts += load_prompts(seed=102, vocab=int(TINY_LLAMA["vocab_size"]), chunk=CHUNK)
        try:
            res["load"] = run_load(kv, prompts, in_flight=IN_FLIGHT, max_tokens=LOAD_TOKENS)
        finally:
            done.set()
            thread.join(timeout=30)
        res["scrapes"] = scrapes
        res["tap_load"] = read_reports(tap_dir)
        calls = _tap_calls(res["tap_load"])
        res["metrics_after"] = vm.wait_for(kv.port, lambda m: _ok(m) >= calls)
        res["preemptions"] = _vllm_preemptions(kv.port)
    load = res["load"]
    record("item1-served", {
        "one_at_a_time": {"requests": 2 * (len(wl.store) + len(wl.warm)),
                          "hits": [a.hit for a in res["kvactors"]["warm"]],
                          "tap": tap_totals(res["tap_single"])},
        "load": {"requests": len(load.answers), "failed": len(load.errors),
                 "hit_tokens": sum(a.hit for a in load.answers if a is not None),
                 "preemptions": res["preemptions"], "tap": tap_totals(res["tap_load"]),
                 "scrapes": len(res["scrapes"]),
                 "metrics_transfers_ok": _ok(res["metrics_after"])},
    })  # fmt: skip
    return res  # the servers are stopped: the results are all collected


@pytest.mark.timeout(600)
def test_served_hits_tokens_and_logprob_bits_equal_native_prefix_caching(
    served: dict[str, Any],
) -> None:
    wl = served["wl"]
    native, kv = served["native"], served["kvactors"]
    hits = [(p.label, p.expected_hit, n.hit, k.hit) for p, n, k in zip(
        wl.warm, native["warm"], kv["warm"], strict=True)]  # fmt: skip
    assert all(exp == n == k for _, exp, n, k in hits), hits
    assert any(k for *_, k in hits)
    for a, b in zip(native["store"] + native["warm"], kv["store"] + kv["warm"], strict=True):
        assert a.bits() == b.bits()


@pytest.mark.timeout(600)
def test_the_tap_ran_in_the_engine_core_and_every_restore_is_bit_identical(
    served: dict[str, Any],
) -> None:
    from kvactors_serving.workload import CHUNK

    reports = served["tap_single"]
    assert reports, "KVACTORS_SERVING_TAP did not reach the engine-core process"
    assert {r["pid"] for r in reports} != {served["server_pid"]}  # a child of the API server
    hits = sum(a.hit for a in served["kvactors"]["warm"])
    assert sum(r["chunks_restored"] for r in reports) * CHUNK == hits
    assert sum(r["chunks_compared"] for r in reports) == hits // CHUNK > 0
    assert sum(r["chunks_unknown"] for r in reports) == 0
    assert [m for r in reports for m in r["mismatches"]] == []
    assert sum(r["differential_chunks"] for r in reports) > 0
    assert [m for r in reports for m in r["differential_mismatches"]] == []


@pytest.mark.timeout(600)
def test_a_concurrent_preempting_load_has_no_failure_and_restores_bit_identical_kv(
    served: dict[str, Any],
) -> None:
    from kvactors_serving.workload import CHUNK

    load = served["load"]
    assert load.errors == []
    assert served["preemptions"] > 0  # the small KV cache made vLLM preempt
    load_hits = sum(a.hit for a in load.answers if a is not None)
    assert load_hits > 0
    before = {r["pid"]: r for r in served["tap_single"]}
    after = served["tap_load"]
    restored = sum(r["chunks_restored"] - before.get(r["pid"], {}).get("chunks_restored", 0)
                   for r in after)  # fmt: skip
    # Every hit LMCache reported was a kvactors restore; a preempted request that is scheduled
    # again restores its prefix again (vLLM reports the first hit), so there may be more.
    assert restored * CHUNK >= load_hits
    assert sum(r["chunks_unknown"] for r in after) == 0
    assert [m for r in after for m in r["mismatches"]] == []
    assert [m for r in after for m in r["differential_mismatches"]] == []


@pytest.mark.timeout(600)
def test_every_kvactors_metric_in_vllms_own_metrics_moves_as_the_tap_counts(
    served: dict[str, Any],
) -> None:
    from kvactors_serving.model import kv_bytes_per_token
    from kvactors_serving.workload import CHUNK

    before, after = served["metrics_before"], served["metrics_after"]
    # What vLLM's /metrics has of kvactors: every family the mirror exports, nothing else.
    assert vm.families(after) == vm.FAMILIES
    mid = [_ok(s) for s in served["scrapes"]]
    assert any(_ok(before) < m < _ok(after) for m in mid), (_ok(before), mid, _ok(after))
    single, tap = served["tap_single"], served["tap_load"]
    # Transfers: one per op call the tap saw, none failed (the tap saw every call succeed).
    assert _ok(before) == _tap_calls(single) > 0
    assert _ok(after) == _tap_calls(tap) > _ok(before)
    assert vm.value(after, "kvactors_transfers_total", result="failed") == 0
    assert ("kvactors_transfers_total", frozenset(
        {"device": "cpu:0", "result": "failed"}.items())) in after  # fmt: skip
    # Bytes: stores move whole chunks; restores the blocks the tap compared (every restored
    # chunk was known: test above), skipped blocks excluded.
    per_token = kv_bytes_per_token("llama")

    def moved(reports: list[dict[str, Any]]) -> int:
        stored = sum(r["chunks_stored"] for r in reports)
        return stored * CHUNK * per_token + sum(r["bytes_compared"] for r in reports)

    assert vm.value(before, "kvactors_bytes_moved_total") == moved(single) > 0
    assert vm.value(after, "kvactors_bytes_moved_total") == moved(tap) > moved(single)
    # Latency: one observation per transfer call, its seconds summed.
    lat = {"op": "transfer"}
    for m, reports in ((before, single), (after, tap)):
        count = vm.value(m, "kvactors_call_latency_seconds_count", **lat)
        assert count == _tap_calls(reports)
        assert vm.value(m, "kvactors_call_latency_seconds_bucket", le="+Inf", **lat) == count
    assert vm.value(after, "kvactors_call_latency_seconds_sum", **lat) > vm.value(
        before, "kvactors_call_latency_seconds_sum", **lat
    )


def _covers(m: dict[vm.Key, float], rounds: dict[str, list[Any]]) -> bool:
    """Whether kvactors' bytes in a scrape cover every hit of its rounds, plus whole chunks."""
    from kvactors_serving.model import kv_bytes_per_token
    from kvactors_serving.workload import CHUNK

    hits = sum(a.hit for r in rounds["kvactors"] for a in r.answers if a is not None)
    restored = vm.value(m, "kvactors_bytes_moved_total") / kv_bytes_per_token("llama")
    return restored >= hits and (restored - hits) % CHUNK == 0


@pytest.fixture(scope="module")
def load_ab(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Item 2: kvactors and LMCache's own op, each behind its own servers, rounds ABBA."""
    from kvactors_serving.api_server import ApiServer
    from kvactors_serving.load import load_prompts, run_load
    from kvactors_serving.model import TINY_LLAMA
    from kvactors_serving.procedure import engine_env
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.workload import CHUNK

    with contextlib.ExitStack() as stack:
        servers = {}
        lmcs = {}
        for side in ("kvactors", "lmcache"):
            lmcs[side] = LMCacheServer(chunk_size=CHUNK, env=engine_env(None))
            stack.callback(lmcs[side].stop)
        for side, backend in (("kvactors", "kvactors"), ("lmcache", "lmcache")):
            env = engine_env(backend)
            if side == "kvactors":
                env |= vm.metrics_env(tmp_path_factory.mktemp("prometheus-multiproc"))
            lmcs[side].wait_ready()
            servers[side] = ApiServer(
                model, env=env, lmcache_port=lmcs[side].port, name=f"vllm-{side}",
                num_blocks=LOAD_BLOCKS, max_model_len=LOAD_LEN,
            )  # fmt: skip
            stack.callback(servers[side].stop)
        for srv in servers.values():
            srv.wait_ready()
        for srv in servers.values():  # warm-up, not counted (first steps, first stores)
            warm = load_prompts(seed=999, vocab=int(TINY_LLAMA["vocab_size"]), chunk=CHUNK)
            assert run_load(srv, warm, in_flight=IN_FLIGHT, max_tokens=LOAD_TOKENS).errors == []
        rounds: dict[str, list[Any]] = {"kvactors": [], "lmcache": []}
        order = ("kvactors", "lmcache", "lmcache", "kvactors")
        for i in range(2 * LOAD_ROUNDS):
            side = order[i % 4]
            # Both sides get the same prompts, each a fresh set: round r of each side.
            prompts = load_prompts(
                seed=1000 + len(rounds[side]), vocab=int(TINY_LLAMA["vocab_size"]), chunk=CHUNK
            )
            rounds[side].append(
                run_load(servers[side], prompts, in_flight=IN_FLIGHT, max_tokens=LOAD_TOKENS)
            )
        return {
            "rounds": rounds,
            "metrics": vm.wait_for(servers["kvactors"].port, lambda m: _covers(m, rounds)),
            "preemptions": {s: _vllm_preemptions(srv.port) for s, srv in servers.items()},
        }


@pytest.mark.timeout(900)
def test_load_kvactors_vs_lmcaches_own_op_no_failures_same_answers_figures_written(
    load_ab: dict[str, Any], tmp_path: Path
) -> None:
    from kvactors_serving.load import summary
    from kvactors_serving.model import kv_bytes_per_token
    from kvactors_serving.workload import CHUNK

    rounds = load_ab["rounds"]
    figures: dict[str, Any] = {side: summary(rs) for side, rs in rounds.items()}
    for side, rs in rounds.items():
        assert [e for r in rs for e in r.errors] == [], side
    assert all(p > 0 for p in load_ab["preemptions"].values()), load_ab["preemptions"]
    # Which request hits what another stored depends on timing, so the hits differ between
    # the sides; the answers must not, but at a near tie (top-two margin under NEAR_TIE) a
    # different batch may pick the other token (docs/validation.md).
    assert figures["kvactors"]["hit_tokens"] > 0
    assert figures["lmcache"]["hit_tokens"] > 0
    for a, b in zip(rounds["kvactors"], rounds["lmcache"], strict=True):
        for x, y in zip(a.answers, b.answers, strict=True):
            assert x is not None
            assert y is not None
            assert _same_or_near_tie(x, y), (x, y)
    m = load_ab["metrics"]
    assert vm.value(m, "kvactors_transfers_total", result="failed") == 0
    assert _ok(m) > 0
    restored = vm.value(m, "kvactors_bytes_moved_total") / kv_bytes_per_token("llama")
    assert restored >= figures["kvactors"]["hit_tokens"]  # every hit moved by kvactors
    assert (restored - figures["kvactors"]["hit_tokens"]) % CHUNK == 0  # plus whole stores
    assert _covers(m, rounds)
    figures["ratio_ttft_p50"] = figures["kvactors"]["ttft_p50_s"] / figures["lmcache"]["ttft_p50_s"]
    figures["rounds"] = {side: [summary([r]) for r in rs] for side, rs in rounds.items()}
    figures["preemptions"] = load_ab["preemptions"]
    results = Path(os.environ.get(RESULTS_ENV) or tmp_path)
    results.mkdir(parents=True, exist_ok=True)
    (results / "served-load.json").write_text(json.dumps(figures, indent=1))
    print(f"served load figures: {results / 'served-load.json'}")
