"""Several engines on one LMCache server, a Redis L2 across a server restart, lost L2 keys.

Runs in the engine's venv (``.venv-vllm``). Engine processes are
``python -m kvactors_serving.engine`` (vLLM's offline engine, one process each, prompts
one at a time); all of them tap the KV through ``KVACTORS_SERVING_TAP`` into one directory, so
a restore in one process is compared bit for bit with the blocks another process stored.
Debian's ``redis-server`` (``scripts/setup-engine.sh`` installs it) and the LMCache servers run
on 127.0.0.1 and are stopped by the fixture's exit stack.

* Item 3: engine A stores on server 1; engine B, another process on the same server, hits what
  A stored; B's tokens and logprob bits equal native prefix caching's; KV bit equality across
  A's store and B's restore.
* Item 4: server 1 is stopped once Redis holds what A stored; server 2 (same Redis, L1 empty)
  serves engine C from L2: hits, tokens and logprob bits as before, KV identical. Server 3
  wraps Redis in LMCache's ``fault_inject`` adapter, which drops keys at load: engine D's
  affected prompts are recomputed (fewer hits), every answer is still correct, kvactors reports
  no failure, and what kvactors restored equals what LMCache served.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from .engine_runs import bits as _bits
from .engine_runs import kv_checks as _kv_checks
from .engine_runs import poll_until
from .engine_runs import run_engine as _engine
from .engine_runs import warm as _warm
from .scenario_record import record

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

FAULT_RATE = 0.5


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvactors_serving.model import TINY_LLAMA, make_model
    from kvactors_serving.procedure import Options, _spec, engine_env
    from kvactors_serving.redis import RedisServer
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.tap import TAP_ENV
    from kvactors_serving.workload import CHUNK, make_workload

    work = tmp_path_factory.mktemp("shared")
    opts = Options(out=work, repeats=1)
    wl = make_workload(seed=0, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=opts.max_tokens)
    model = make_model("llama", work / "model", seed=0)
    env = engine_env("kvactors") | {TAP_ENV: str(work / "tap")}
    res: dict[str, Any] = {"wl": wl, "tap_dir": work / "tap"}
    with contextlib.ExitStack() as stack:
        redis = RedisServer()
        stack.callback(redis.stop)
        resp = {"type": "resp", "host": "127.0.0.1", "port": redis.port, "num_workers": 2}
        server_env = engine_env(None)
        srv1 = LMCacheServer(chunk_size=CHUNK, env=server_env, l2_adapters=(resp,))
        stack.callback(srv1.stop)
        redis.wait_ready()
        res["native"] = _engine(
            work, _spec(opts, "native", model, wl, prefix_caching=True,
                        phases=["store", "warm_single"]), engine_env(None),
        )  # fmt: skip
        srv1.wait_ready()
        res["A"] = _engine(work, _spec(opts, "A", model, wl, port=srv1.port, phases=["store"]), env)
        res["B"] = _engine(
            work, _spec(opts, "B", model, wl, port=srv1.port, phases=["warm_single"]), env
        )
        n = res["A"]["tap"]["chunks_stored"]
        res["redis_keys"] = poll_until(f"Redis's keys (>= {n})", redis.keys, lambda k: k >= n)
        srv1.stop()
        srv2 = LMCacheServer(chunk_size=CHUNK, env=server_env, l2_adapters=(resp,))
        stack.callback(srv2.stop)
        srv2.wait_ready()
        res["C"] = _engine(
            work, _spec(opts, "C", model, wl, port=srv2.port, phases=["warm_single"]), env
        )
        srv2.stop()
        fault = {"type": "fault_inject", "inner": resp, "rate": FAULT_RATE, "seed": 0}
        srv3 = LMCacheServer(chunk_size=CHUNK, env=server_env, l2_adapters=(fault,))
        stack.callback(srv3.stop)
        srv3.wait_ready()
        res["D"] = _engine(
            work, _spec(opts, "D", model, wl, port=srv3.port, phases=["warm_single"]), env
        )
        res["srv3_log"] = srv3.log()
        record("items3-4-shared", {
            name: {"requests": len(_warm(r)) if name != "A" else len(wl.store),
                   "hits": [o["hit"] for o in _warm(r)] if name != "A" else [],
                   "tap": r["tap"] | {"mismatches": len(r["tap"]["mismatches"])},
                   "runtime": r["runtime"]}
            for name, r in res.items() if name in ("A", "B", "C", "D")
        } | {"redis_keys": res["redis_keys"]})  # fmt: skip
        yield res


@pytest.mark.timeout(900)
def test_a_second_engine_on_the_same_server_hits_what_the_first_stored(
    shared: dict[str, Any],
) -> None:
    wl, native, b = shared["wl"], shared["native"], shared["B"]
    assert shared["A"]["tap"]["chunks_stored"] > 0
    assert shared["A"]["tap"]["differential_mismatches"] == []
    for p, n, o in zip(wl.warm, _warm(native), _warm(b), strict=True):
        assert o["hit"] == n["hit"] == p.expected_hit, p.label
        assert _bits(o) == _bits(n), p.label
    _kv_checks(b)
    assert b["tap"]["chunks_stored"] == 0  # B only restored: the comparisons were with A's blocks


@pytest.mark.timeout(900)
def test_after_a_server_restart_the_hits_come_back_from_redis_bit_identical(
    shared: dict[str, Any],
) -> None:
    wl, native, c = shared["wl"], shared["native"], shared["C"]
    assert shared["redis_keys"] >= shared["A"]["tap"]["chunks_stored"]
    for p, n, o in zip(wl.warm, _warm(native), _warm(c), strict=True):
        assert o["hit"] == n["hit"] == p.expected_hit, p.label
        assert _bits(o) == _bits(n), p.label
    _kv_checks(c)


@pytest.mark.timeout(900)
def test_lost_l2_keys_are_recomputed_correctly_and_are_no_kvactors_failure(
    shared: dict[str, Any],
) -> None:
    from kvactors_serving.procedure import NEAR_TIE

    wl, native, d = shared["wl"], shared["native"], shared["D"]
    warm = _warm(d)
    assert any(o["hit"] < p.expected_hit for p, o in zip(wl.warm, warm, strict=True)), (
        "the fault adapter dropped no key that a prompt needed"
    )
    for p, n, o in zip(wl.warm, _warm(native), warm, strict=True):
        assert o["hit"] <= p.expected_hit
        assert o["hit"] % 64 == 0
        for i, (x, y) in enumerate(zip(o["tokens"], n["tokens"], strict=True)):
            if x != y:  # only at a near tie: a shorter hit computes with other shapes
                tops = [[float.fromhex(t) for t in r["steps"][i]["top2"]] for r in (o, n)]
                margin = min(t[0] - t[1] for t in tops)
                assert margin < NEAR_TIE, (p.label, i)
                break
    if any(o["hit"] for o in warm):
        _kv_checks(d)
    else:
        assert d["runtime"]["transfers_failed"] == 0


def test_the_servers_hash_survives_a_restart_and_the_readme_uses_it() -> None:
    from kvactors_serving.server import HASH_ALGORITHM, server_command

    assert HASH_ALGORITHM != "builtin"
    cmd = server_command("python", 1, 64)
    assert cmd[cmd.index("--hash-algorithm") + 1] == HASH_ALGORITHM
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [ln for ln in readme.splitlines() if "--hash-algorithm" in ln]
    assert lines
    assert all(f"--hash-algorithm {HASH_ALGORITHM}" in ln for ln in lines), lines
    assert os.environ.get("PYTHONHASHSEED") != "random"
