"""One engine configuration in this process: ``python -m kvactors_serving.engine SPEC OUT``.

Runs in the engine's environment (``.venv-vllm``): vLLM's CPU build with the engine core in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the LMCache connector's worker, its
resolved device ops and the tap (:mod:`kvactors_serving.tap`) are all here. ``SPEC`` is
a JSON file written by :mod:`kvactors_serving.procedure`; the results go to ``OUT`` as
JSON. Phases, in the order the spec lists them:

* ``cold``: every warm prompt alone, the prefix cache reset before each (hit 0);
* ``store``: the store prompts, one at a time;
* ``warm_single``: every warm prompt alone (``repeats`` times);
* ``warm_batched``: all warm prompts in one ``generate`` (``repeats`` times), with the batch
  timeline (the requests and tokens of every engine step) recorded;
* ``preempt_batched``: the preemption batch (short prompts) in one ``generate``;
* ``bench``: A/B pairs, alternating kvactors' op and LMCache's own CPU op per pair, each pair
  storing a fresh prompt and then serving its warm twin alone (time to first token and the
  op's store/retrieve time).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ("main",)


class _Timeline:
    """Wraps the engine core's scheduler: the requests and tokens of every step."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[dict[str, int]] = []
        self.recording = False
        schedule = scheduler.schedule

        def recorded_schedule(*a: Any, **k: Any) -> Any:
            out = schedule(*a, **k)
            tokens = dict(getattr(out, "num_scheduled_tokens", {}) or {})
            if self.recording and tokens:
                self.steps.append({str(r): int(n) for r, n in sorted(tokens.items())})
            return out

        scheduler.schedule = recorded_schedule


def _label(outs: list[dict[str, Any]], engine_id: str) -> str:
    # The engine core's id is the output's request id plus a random suffix ("20-bd82bcd3").
    for o in outs:
        if engine_id == o["request_id"] or engine_id.startswith(o["request_id"] + "-"):
            return str(o["label"])
    return engine_id


def _scheduler(llm: Any) -> Any:
    core = llm.llm_engine.engine_core
    return getattr(core, "engine_core", core).scheduler


def _result(out: Any, label: str) -> dict[str, Any]:
    comp = out.outputs[0]
    steps = []
    for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=False):
        ranked = sorted((float(v.logprob) for v in lp.values()), reverse=True)
        steps.append(
            {
                "token": int(tok),
                "logprob": float(lp[tok].logprob).hex(),
                "top2": [x.hex() for x in ranked[:2]],
            }
        )
    metrics = getattr(out, "metrics", None)
    return {
        "label": label,
        "request_id": str(out.request_id),
        # vLLM's own per-request statistics (RequestStateStats, with log stats on)
        "preemptions": int(getattr(metrics, "num_preemptions", 0) or 0),
        "ttft_s": float(getattr(metrics, "first_token_latency", 0.0) or 0.0),
        "hit": int(out.num_cached_tokens or 0),
        "tokens": [int(t) for t in comp.token_ids],
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the spec at ``argv[0]``, write the results to ``argv[1]``; exit status 0."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    out_path = Path(args[1])
    from kvactors_lmcache.vllm_cpu import patch_llvmlite_lib

    patched = patch_llvmlite_lib()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "block_size": spec["block_size"],
        "enforce_eager": True,
        "max_model_len": spec["max_model_len"],
        "enable_prefix_caching": bool(spec["prefix_caching"]),
        "seed": 0,
        "disable_log_stats": False,  # vLLM's per-request statistics (preemptions, TTFT)
    }
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks_override"])
    if spec.get("port"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": int(spec["port"]),
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {
        "config": spec["name"],
        "llvmlite_patched": patched,
        "engine_start_s": time.perf_counter() - t0,
        "phases": {},
    }
    tap = None
    if spec.get("port"):
        from lmcache.v1.platform import resolve_device_ops

        from kvactors_serving.tap import install

        tap = install(corrupt_restore=bool(spec.get("corrupt_restore")))
        ops = resolve_device_ops("cpu")
        result["ops"] = f"{type(ops).__module__}.{type(ops).__qualname__}"
    timeline = _Timeline(_scheduler(llm))

    params = SamplingParams(
        temperature=0.0, max_tokens=int(spec["max_tokens"]), logprobs=2, ignore_eos=True
    )
    store = [(p["label"], p["tokens"]) for p in spec["store"]]
    warm = [(p["label"], p["tokens"]) for p in spec["warm"]]
    short = [(p["label"], p["tokens"]) for p in spec["preempt"]]

    def generate(prompts: list[tuple[str, list[int]]], sp: Any = params) -> list[dict[str, Any]]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=list(t)) for _, t in prompts], sp, use_tqdm=False
        )
        return [_result(o, label) for o, (label, _) in zip(outs, prompts, strict=True)]

    def fresh_prefix_cache() -> None:
        # Native prefix caching keeps what the last repeat computed (its own prompts' blocks
        # too); each repeat starts from the store prompts alone, as the LMCache runs do.
        if spec["prefix_caching"]:
            llm.reset_prefix_cache()
            generate(store)

    phases: dict[str, Any] = result["phases"]
    for phase in spec["phases"]:
        if phase == "cold":
            runs = []
            for p in warm:
                llm.reset_prefix_cache()
                runs += generate([p])
            llm.reset_prefix_cache()
            phases["cold"] = runs
        elif phase == "store":
            phases["store"] = [r for p in store for r in generate([p])]
        elif phase == "warm_single":
            singles = []
            for i in range(spec["repeats"]):
                if i:
                    fresh_prefix_cache()
                singles.append([r for p in warm for r in generate([p])])
            phases["warm_single"] = singles
        elif phase == "warm_batched":
            runs = []
            for _ in range(spec["repeats"]):
                fresh_prefix_cache()
                timeline.steps = []
                timeline.recording = True
                outs = generate(warm)
                timeline.recording = False
                steps = [{_label(outs, r): n for r, n in s.items()} for s in timeline.steps]
                runs.append({"outputs": outs, "timeline": steps})
            phases["warm_batched"] = runs
        elif phase == "preempt_batched":
            phases["preempt_batched"] = generate(short)
        elif phase == "bench":
            _counters(result, tap)  # the checks' counters exclude the A/B pairs
            phases["bench"] = _bench(spec, tap, generate, SamplingParams)
    if "tap" not in result:
        _counters(result, tap)
    out_path.write_text(json.dumps(result))
    return 0


def _counters(result: dict[str, Any], tap: Any) -> None:
    """The tap's report, kvactors' per-process call counts and its runtime's statistics."""
    if tap is not None:
        result["tap"] = tap.report()
        result["plugin_calls"] = {}
        if result["ops"].startswith("kvactors_lmcache."):
            from kvactors.runtime import get_runtime
            from kvactors_lmcache.ops import transfer_counts

            result["plugin_calls"] = transfer_counts()
            st = get_runtime(backend="cpu", device_index=0).statistics()
            result["runtime"] = {
                "transfers_ok": st.transfers_ok,
                "transfers_failed": st.transfers_failed,
                "bytes_moved": st.bytes_moved,
            }


def _bench(spec: dict[str, Any], tap: Any, generate: Any, sampling: Any) -> list[dict[str, Any]]:
    """``bench`` requests per side, alternated kvactors, LMCache, LMCache, kvactors (ABBA, so a
    drift of the machine's speed weighs on both alike)."""
    if tap is None:
        raise SystemExit("bench needs the LMCache connector (a server port)")
    one = sampling(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(spec.get("seed", 0) + 7)
    vocab, prefix, chunk = spec["vocab"], spec["bench_prefix"], spec["chunk_size"]
    rows = []
    tap.check = False
    for i in range(2 * int(spec["bench"])):
        who = ("kvactors", "lmcache", "lmcache", "kvactors")[i % 4]
        tap.use_reference = who == "lmcache"
        base = [rng.randrange(3, vocab) for _ in range(prefix + chunk // 2)]
        s0 = dict(tap.seconds)
        generate([(f"bench-store-{i}", base)], one)
        s1 = dict(tap.seconds)
        warm = base[:prefix] + [rng.randrange(3, vocab) for _ in range(8)]
        t0 = time.perf_counter()
        out = generate([(f"bench-warm-{i}", warm)], one)
        ttft = time.perf_counter() - t0
        s2 = dict(tap.seconds)
        rows.append(
            {
                "ops": who,
                "hit": out[0]["hit"],
                "ttft_s": ttft,
                "store_s": s1["store"] - s0["store"],
                "retrieve_s": s2["retrieve"] - s1["retrieve"],
            }
        )
    tap.use_reference = False
    tap.check = True
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
