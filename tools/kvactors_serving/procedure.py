"""The serving validation: run the engine configurations, judge every check, write the report.

Configurations (one engine process each, :mod:`kvactors_serving.engine`):

* ``native``: vLLM's native prefix caching, no connector: the cold runs (prefix cache reset
  before each prompt), then the warm prompts one at a time and batched, after the store prompts;
* ``lmcache``: no prefix caching, LMCache's MP connector and server, the device ops LMCache
  resolves (kvactors' ``kvactors_cpu`` plugin, or LMCache's own with ``backend="lmcache"``),
  tapped: store prompts, warm prompts one at a time and batched, optional A/B pairs (bench);
* ``preempt``: as ``lmcache`` with a KV cache so small that vLLM preempts requests
  (``num_gpu_blocks_override``), its own server.

Every check gets a verdict: PASS, FAIL, REPORTED (figures without a pass/fail rule),
NOT APPLICABLE or SKIPPED, with the reason.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvactors.core.plugins import PLUGIN_CPU
from kvactors.errors import BackendUnavailableError, MissingDependencyError
from kvactors_serving.model import TINY_LLAMA, kv_bytes_per_token, make_model
from kvactors_serving.server import LMCacheServer
from kvactors_serving.workload import BLOCK, CHUNK, Workload, make_workload

__all__ = ("HARNESS_PATH", "Options", "engine_env", "run")

NEAR_TIE = 1e-3
"""Top-two logprob margin (nats) under which a changed token is a near-tie, not a failure."""
BENCH_TOLERANCE = 0.05
"""kvactors' median may be at most this fraction above LMCache's own op's."""


@dataclass
class Options:
    """What to run (the command's flags)."""

    out: Path
    backend: str = "kvactors"  # "kvactors" (kvactors_cpu plugin) or "lmcache" (its own ops)
    repeats: int = 2
    max_tokens: int = 16
    seed: int = 0
    bench: int = 0  # A/B pairs per side in the lmcache engine (0: no bench)
    corrupt_restore: bool = False
    preempt: bool = True
    preempt_tokens: int = 320  # the preempting engine's KV cache (and max_model_len): 3 of the
    # 6 short prompts fit, then they outgrow it
    python: str = sys.executable
    configs: tuple[str, ...] = ("native", "lmcache", "preempt")
    model: str = "llama"  # "llama" (format 12) or "mla" (DeepSeek-V2 style, format 3)
    log: Any = field(default=None)


def block_size(model: str) -> int:
    """vLLM's block size for the model: CPU_ATTN takes 32; CPU_MLA insists on 16."""
    return 16 if model == "mla" else BLOCK


def attention_backend(model: str) -> str | None:
    """vLLM's attention backend for the model, named: an MLA model runs vLLM's CPU_MLA
    (float32, format 3) also where the CPU has AMX, where vLLM would take AMX_MLA, which
    takes 16-bit weights only; else vLLM's choice (CPU_ATTN)."""
    return "CPU_MLA" if model == "mla" else None


def preempt_blocks(opts: Options) -> int:
    """``num_gpu_blocks_override`` of the preempting engine: its tokens plus the null block."""
    return opts.preempt_tokens // block_size(opts.model) + 1


HARNESS_PATH = str(Path(__file__).resolve().parents[1])
"""The folder that holds this package (a checkout's ``tools/``). The harness is not installed,
so every process it starts gets this folder first on ``PYTHONPATH``."""


def engine_env(backend: str | None) -> dict[str, str]:
    """The environment of an engine process (``backend``: None without a connector)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVACTORS_"))}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != HARNESS_PATH]
    env["PYTHONPATH"] = os.pathsep.join([HARNESS_PATH, *paths])
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core (and the worker) in-process
        VLLM_CPU_KVCACHE_SPACE="1",
        LMCACHE_TRACK_USAGE="false",
        PYTHONHASHSEED="0",
        PYTHONUNBUFFERED="1",
    )
    if backend is not None:
        env["LMCACHE_MP_TRANSFER_MODE"] = "engine_driven"
    if backend == "kvactors":
        env.update(LMCACHE_DEVICE_BACKEND=PLUGIN_CPU, KVACTORS_LMCACHE_CPU="1")
    return env


def _say(opts: Options, msg: str) -> None:
    if opts.log is not None:
        print(f"[validate-serving] {msg}", file=opts.log, flush=True)


def _spec(opts: Options, name: str, model: Path, wl: Workload, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": str(model),
        "block_size": block_size(opts.model),
        "attention_backend": attention_backend(opts.model),
        "chunk_size": CHUNK,
        "max_model_len": 512,
        "prefix_caching": False,
        "max_tokens": opts.max_tokens,
        "repeats": opts.repeats,
        "seed": opts.seed,
        "vocab": int(TINY_LLAMA["vocab_size"]),
        "bench_prefix": 4 * CHUNK,
        "store": [p.as_json() for p in wl.store],
        "warm": [p.as_json() for p in wl.warm],
        "preempt": [p.as_json() for p in wl.preempt],
    }
    spec.update(extra)
    return spec


def _run_engine(opts: Options, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    work = opts.out / "engines"
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{spec['name']}.spec.json"
    out_path = work / f"{spec['name']}.json"
    log_path = work / f"{spec['name']}.log"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [opts.python, "-m", "kvactors_serving.engine", str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    _say(opts, f"engine {spec['name']}: exit {proc.returncode} in {time.monotonic() - t0:.0f} s")
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise BackendUnavailableError(
            backend=f"engine {spec['name']}", reason=f"exited {proc.returncode}:\n{tail}"
        )
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def run(opts: Options) -> dict[str, Any]:
    """Run the configurations in ``opts`` and return the report (also written to ``opts.out``)."""
    opts.out.mkdir(parents=True, exist_ok=True)
    wl = make_workload(
        seed=opts.seed, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=opts.max_tokens
    )
    model = make_model(opts.model, opts.out / "model", seed=opts.seed)
    server_env = engine_env(None)
    servers: dict[str, LMCacheServer] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        # Servers start first and load while the native engine runs (one per connector
        # configuration: each tap knows only the chunks its own process stored).
        for name in ("lmcache", "preempt"):
            if name in opts.configs and (name != "preempt" or opts.preempt):
                servers[name] = LMCacheServer(chunk_size=CHUNK, env=server_env, python=opts.python)
        if "native" in opts.configs:
            results["native"] = _run_engine(
                opts,
                _spec(
                    opts,
                    "native",
                    model,
                    wl,
                    prefix_caching=True,
                    phases=["cold", "store", "warm_single", "warm_batched"],
                ),
                engine_env(None),
            )
        if "lmcache" in servers:
            servers["lmcache"].wait_ready()
            phases = ["store", "warm_single", "warm_batched"]
            phases += ["preempt_batched"] if "preempt" in servers else []
            phases += ["bench"] if opts.bench else []
            results["lmcache"] = _run_engine(
                opts,
                _spec(
                    opts,
                    "lmcache",
                    model,
                    wl,
                    port=servers["lmcache"].port,
                    phases=phases,
                    bench=opts.bench,
                    corrupt_restore=opts.corrupt_restore,
                ),
                engine_env(opts.backend),
            )
        if "preempt" in servers:
            servers["preempt"].wait_ready()
            results["preempt"] = _run_engine(
                opts,
                _spec(
                    opts,
                    "preempt",
                    model,
                    wl,
                    port=servers["preempt"].port,
                    repeats=1,
                    max_model_len=opts.preempt_tokens,
                    num_gpu_blocks_override=preempt_blocks(opts),
                    phases=["store", "preempt_batched"],
                ),
                engine_env(opts.backend),
            )
    finally:
        for srv in servers.values():
            srv.stop()
    report = judge(opts, wl, results)
    write(opts, report)
    return report


# -- the checks ------------------------------------------------------------------------------


def _check(name: str, verdict: str, detail: str, **data: Any) -> dict[str, Any]:
    return {"check": name, "verdict": verdict, "detail": detail, **data}


def _bits(o: dict[str, Any]) -> list[Any]:
    return [o["tokens"], [(s["logprob"], s["top2"]) for s in o["steps"]]]


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |logprob difference| over the steps both share the token of (0.0 if none)."""
    worst = 0.0
    for sa, sb in zip(a["steps"], b["steps"], strict=False):
        if sa["token"] != sb["token"]:
            break
        worst = max(worst, abs(float.fromhex(sa["logprob"]) - float.fromhex(sb["logprob"])))
    return worst


def _first_divergence(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)):
        if x != y:
            return i
    return None


def _margin(step: dict[str, Any]) -> float:
    top = [float.fromhex(x) for x in step["top2"]]
    return top[0] - top[1] if len(top) == 2 else float("inf")


def judge(opts: Options, wl: Workload, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every check's verdict from the engines' results."""
    checks: list[dict[str, Any]] = []
    native, lmc, pre = results.get("native"), results.get("lmcache"), results.get("preempt")
    expected = {p.label: p.expected_hit for p in wl.warm}
    bpt = kv_bytes_per_token(opts.model)  # bytes of KV per token, every layer
    plots: dict[str, dict[str, float]] = {}

    if native and lmc and not any(o["hit"] for o in native["phases"]["warm_single"][0]):
        # vLLM's CPU MLA backend serves no prefix-cache hits: no native warm run to compare.
        why = (
            "vLLM's native prefix caching served no hit on any prompt with this model (its "
            "CPU MLA backend), so there is no native warm run at equal hit lengths"
        )
        lm_hits = [o["hit"] for o in lmc["phases"]["warm_single"][0]]
        ok = lm_hits == [expected[o["label"]] for o in lmc["phases"]["warm_single"][0]]
        checks.append(
            _check(
                "hit lengths",
                "PASS" if ok else "FAIL",
                f"LMCache's hits equal the designed ones; native: NOT APPLICABLE ({why})",
                hits=[
                    {
                        "prompt": o["label"],
                        "expected": expected[o["label"]],
                        "native": 0,
                        "lmcache": o["hit"],
                    }
                    for o in lmc["phases"]["warm_single"][0]
                ],
            )
        )
        for name in (
            "one at a time: tokens and logprob bits vs native",
            "batched: tokens vs native (logprob differences reported)",
        ):
            checks.append(_check(name, "NOT APPLICABLE", why))
        native = None  # the cold-vs-warm figures below need a native warm run too
    if native and lmc:
        rows = []
        ok = True
        for n, m in zip(
            native["phases"]["warm_single"][0], lmc["phases"]["warm_single"][0], strict=True
        ):
            rows.append(
                {
                    "prompt": n["label"],
                    "expected": expected[n["label"]],
                    "native": n["hit"],
                    "lmcache": m["hit"],
                }
            )
            ok &= n["hit"] == m["hit"] == expected[n["label"]]
        for run_n, run_m in zip(
            native["phases"]["warm_batched"], lmc["phases"]["warm_batched"], strict=True
        ):
            for n, m in zip(run_n["outputs"], run_m["outputs"], strict=True):
                ok &= n["hit"] == m["hit"] == expected[n["label"]]
        checks.append(
            _check(
                "hit lengths",
                "PASS" if ok else "FAIL",
                "LMCache's hits equal native prefix caching's and the designed ones "
                "(chunk-aligned, not aligned, zero), alone and batched",
                hits=rows,
            )
        )

    if lmc:
        ops = str(lmc.get("ops", "?"))
        mine = ops.startswith("kvactors_lmcache.")
        tap = lmc["tap"]
        if opts.backend == "kvactors":
            calls = lmc.get("plugin_calls", {})
            rt = lmc.get("runtime", {})
            hits_all = (
                sum(o["hit"] for r in lmc["phases"]["warm_single"] for o in r)
                + sum(o["hit"] for r in lmc["phases"]["warm_batched"] for o in r["outputs"])
                + sum(o["hit"] for o in lmc["phases"].get("preempt_batched", []))
            )
            want_bytes = (hits_all + tap["chunks_stored"] * CHUNK) * bpt
            ok = (
                mine
                and calls.get("cpu:D2H", 0) == tap["op_calls"]["store"] > 0
                and calls.get("cpu:H2D", 0) == tap["op_calls"]["retrieve"] > 0
                and rt.get("transfers_ok") == tap["op_calls"]["store"] + tap["op_calls"]["retrieve"]
                and rt.get("transfers_failed") == 0
                and rt.get("bytes_moved") == want_bytes
                and tap["chunks_restored"] * CHUNK == hits_all
            )
            checks.append(
                _check(
                    "kvactors moved the KV",
                    "PASS" if ok else "FAIL",
                    "LMCache's resolved ops are kvactors'; its calls, the runtime's transfers and "
                    "bytes moved match the stores and LMCache's hits",
                    ops=ops,
                    plugin_calls=calls,
                    runtime=rt,
                    expected_bytes=want_bytes,
                    hit_tokens=hits_all,
                    chunks_stored=tap["chunks_stored"],
                )
            )
        else:
            checks.append(
                _check(
                    "kvactors moved the KV",
                    "SKIPPED",
                    f"--backend lmcache: LMCache's own ops ({ops}) served",
                    ops=ops,
                )
            )
        for name, res in (("lmcache", lmc), ("preempt", pre)):
            if res is None:
                continue
            t = res["tap"]
            ok = not t["mismatches"] and t["chunks_compared"] > 0 and t["chunks_unknown"] == 0
            named = [
                f"chunk {m['chunk']} ({m['stored_as']}): restore call {m['restore_call']}, "
                f"block {m['block']}, layer {m['layer']}, {m['differing_bytes']} bytes differ"
                for m in t["mismatches"]
            ]
            checks.append(
                _check(
                    f"KV bit equality, store vs restore ({name})",
                    "PASS" if ok else "FAIL",
                    f"{t['chunks_compared']} restored chunks, {t['layer_blocks_compared']} "
                    f"layer-blocks, {t['bytes_compared']} bytes compared; {len(t['mismatches'])} "
                    f"mismatched; {t['chunks_unknown']} restored chunks never stored",
                    mismatches=named[:20],
                    corrupted=t["corrupted"],
                )
            )
        if mine:
            ok = (
                not tap["differential_mismatches"]
                and tap["differential_chunks"] == tap["chunks_stored"] > 0
            )
            checks.append(
                _check(
                    "stored chunks vs LMCache's own op",
                    "PASS" if ok else "FAIL",
                    f"{tap['differential_chunks']} host chunks kvactors stored, each compared byte "
                    "for byte with LMCache's own CPU op on the same blocks",
                    mismatches=tap["differential_mismatches"][:20],
                )
            )
        else:
            checks.append(
                _check(
                    "stored chunks vs LMCache's own op",
                    "SKIPPED",
                    "LMCache's own op served the stores (nothing to compare)",
                )
            )

    if native and lmc:
        same = 0
        diffs: list[str] = []
        single = plots.setdefault("one at a time", {})
        for r, run_m in enumerate(lmc["phases"]["warm_single"]):
            for n, m in zip(native["phases"]["warm_single"][r], run_m, strict=True):
                if _bits(n) == _bits(m):
                    same += 1
                else:
                    diffs.append(f"repeat {r} {n['label']}: max |d logprob| {_max_diff(n, m):.3g}")
                single[n["label"]] = max(single.get(n["label"], 0.0), _max_diff(n, m))
        total = sum(len(r) for r in lmc["phases"]["warm_single"])
        checks.append(
            _check(
                "one at a time: tokens and logprob bits vs native",
                "PASS" if not diffs else "FAIL",
                f"{same}/{total} requests identical in tokens and logprob bits "
                f"({opts.repeats} repeats)",
                differences=diffs,
            )
        )
        tok_ok = True
        runs = []
        batched = plots.setdefault("batched", {})
        for r, (run_n, run_m) in enumerate(
            zip(native["phases"]["warm_batched"], lmc["phases"]["warm_batched"], strict=True)
        ):
            per = {}
            for n, m in zip(run_n["outputs"], run_m["outputs"], strict=True):
                tok_ok &= n["tokens"] == m["tokens"]
                d = _max_diff(n, m)
                per[n["label"]] = d
                batched[n["label"]] = max(batched.get(n["label"], 0.0), d)
            runs.append(
                {
                    "repeat": r,
                    "max_abs_logprob_diff": per,
                    "native_steps": run_n["timeline"],
                    "lmcache_steps": run_m["timeline"],
                }
            )
        differing = sum(1 for r in runs for d in r["max_abs_logprob_diff"].values() if d)
        checks.append(
            _check(
                "batched: tokens vs native (logprob differences reported)",
                "PASS" if tok_ok else "FAIL",
                f"tokens {'identical' if tok_ok else 'DIFFER'}; logprobs differ on {differing} "
                "prompt-runs; each run's batch timeline (requests and tokens per engine step) "
                "is in the JSON: LMCache's asynchronous lookups admit requests in other steps",
                runs=runs,
            )
        )
        rep_ok = all(
            [_bits(o) for o in run] == [_bits(o) for o in res["phases"]["warm_single"][0]]
            for res in (native, lmc)
            for run in res["phases"]["warm_single"]
        )
        checks.append(
            _check(
                "repeated runs (one at a time)",
                "PASS" if rep_ok else "FAIL",
                f"{opts.repeats} repeats of every configuration bit-identical",
            )
        )
        cold = plots.setdefault("cold vs native warm", {})
        for c, w in zip(native["phases"]["cold"], native["phases"]["warm_single"][0], strict=True):
            cold[c["label"]] = _max_diff(c, w)
        checks.append(
            _check(
                "cold vs warm (reference only)",
                "REPORTED",
                "a cold prefill runs other kernels than a warm one; differences here are not "
                "failures",
                max_abs_logprob_diff=cold,
            )
        )

    if pre is not None and lmc is not None:
        n_pre = sum(o["preemptions"] for o in pre["phases"]["preempt_batched"])
        ref = {o["label"]: o for o in lmc["phases"]["preempt_batched"]}
        bad, notes = [], []
        for o in pre["phases"]["preempt_batched"]:
            i = _first_divergence(ref[o["label"]], o)
            if i is None:
                continue
            margin = _margin(ref[o["label"]]["steps"][i])
            notes.append(f"{o['label']}: token {i} differs, top-two margin {margin:.3g}")
            if margin >= NEAR_TIE:
                bad.append(notes[-1])
        ok = n_pre > 0 and not bad
        verdict = "PASS" if ok else "FAIL"
        detail = (
            f"vLLM preempted {n_pre} times (num_gpu_blocks_override={preempt_blocks(opts)}); "
            f"{len(notes)} prompts diverge, {len(bad)} where the top two logprobs are "
            f"{NEAR_TIE} or more apart"
        )
        if opts.model == "mla" and n_pre > 0:
            # Batched MLA outputs on vLLM's CPU build depend on the batch beyond near-ties
            # (docs/validation.md, MLA), so only the KV checks judge the preempting run.
            verdict = "REPORTED"
            detail += "; MLA batches on vLLM's CPU build are not batch-invariant: not judged"
        checks.append(
            _check(
                "preemption: tokens vs the run without",
                verdict,
                detail,
                preemptions=n_pre,
                divergences=notes,
            )
        )

    checks.append(
        _check(
            "synchronization control",
            "NOT APPLICABLE",
            "CPU: every copy completes before the op returns and there are no streams, so a "
            "synchronized run is the same run. An accelerator run would need a control that "
            "syncs the device around the connector's calls; this procedure runs on CPU only",
        )
    )
    if opts.model != "mla":
        checks.append(
            _check(
                "MLA (format 3)",
                "SKIPPED",
                "this run's model is Llama-style (format 12); --model mla runs the checks on a "
                "DeepSeek-V2-style model (vLLM's CPU_MLA backend, format 3)",
            )
        )
    if lmc is not None and opts.bench:
        checks += _bench_checks(lmc["phases"]["bench"])
    elif opts.bench == 0:
        checks.append(_check("engine speed (A/B)", "SKIPPED", "not asked (--bench N)"))
    failed = [c["check"] for c in checks if c["verdict"] == "FAIL"]
    return {
        "verdict": "FAIL" if failed else "PASS",
        "failed": failed,
        "device": "cpu",
        "backend": opts.backend,
        "model": opts.model,
        "simulated": [],
        "checks": checks,
        "plot": plots,
        "engines": {
            k: {
                "ops": v.get("ops"),
                "engine_start_s": v.get("engine_start_s"),
                "tap": v.get("tap"),
                "runtime": v.get("runtime"),
            }
            for k, v in results.items()
        },
        "options": {
            "repeats": opts.repeats,
            "max_tokens": opts.max_tokens,
            "seed": opts.seed,
            "bench": opts.bench,
            "corrupt_restore": opts.corrupt_restore,
        },
    }


def _bench_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    figures: dict[str, dict[str, float]] = {}
    for who in ("kvactors", "lmcache"):
        mine = [r for r in rows if r["ops"] == who]
        figures[who] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("ttft_s", "store_s", "retrieve_s")
        }
    ratio = {k: figures["kvactors"][k] / figures["lmcache"][k] for k in figures["kvactors"]}
    n = len(rows) // 2
    limit = 1 + BENCH_TOLERANCE
    ttft = _check(
        "engine speed: warm TTFT (A/B)",
        "PASS" if ratio["ttft_s"] <= limit else "FAIL",
        f"median time to first token of a warm request (256 tokens hit), kvactors/LMCache's own "
        f"op {ratio['ttft_s']:.3f} ({n} requests per side, alternated ABBA; limit {limit:.2f})",
        medians=figures,
        ratios=ratio,
        rows=rows,
    )
    ops = _check(
        "engine speed: store/retrieve time per request (A/B)",
        "PASS" if max(ratio["store_s"], ratio["retrieve_s"]) <= limit else "FAIL",
        f"median op time per request, kvactors/LMCache's own op: store {ratio['store_s']:.3f}, "
        f"retrieve {ratio['retrieve_s']:.3f} (limit {limit:.2f})",
    )
    return [ttft, ops]


# -- the outputs ------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    """The report as a readable table."""
    lines = [
        f"serving validation ({report['device']}, model {report['model']}, "
        f"ops: {report['backend']}): {report['verdict']}",
        "",
    ]
    width = max(len(c["check"]) for c in report["checks"])
    for c in report["checks"]:
        lines.append(f"{c['check']:<{width}}  {c['verdict']:<14}  {c['detail']}")
        for extra in c.get("mismatches", []) + c.get("differences", []):
            lines.append(f"{'':<{width}}  {'':<14}  - {extra}")
    return "\n".join(lines)


def write(opts: Options, report: dict[str, Any]) -> None:
    """``report.json``, ``report.txt`` and ``logprob-diff.png`` into ``opts.out``; without
    matplotlib the plot is left out, with a line on stderr that says how to get it."""
    (opts.out / "report.json").write_text(json.dumps(report, indent=1))
    (opts.out / "report.txt").write_text(table(report) + "\n")
    try:
        _plot(report["plot"], opts.out / "logprob-diff.png")
    except MissingDependencyError as exc:
        print(f"logprob-diff.png not written: {exc}", file=sys.stderr)


def _plot(series: dict[str, dict[str, float]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "the plot needs matplotlib: pip install 'kvactors[bench]'", package="matplotlib"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    floor = 1e-9
    for i, (name, per) in enumerate(series.items()):
        labels = list(per)
        xs = [j + 0.25 * i for j in range(len(labels))]
        ax.bar(xs, [max(v, floor) for v in per.values()], width=0.25, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    if not series:
        ax.text(0.5, 0.5, "no native run to compare with", ha="center", transform=ax.transAxes)
    ax.set_ylabel(f"max |logprob difference| (0 drawn at {floor:g})")
    ax.set_title("Per prompt: LMCache warm vs native prefix reuse")
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvactors_serving``: exit 0 when no check failed, 1 otherwise."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="kvactors validate-serving", description="vLLM + LMCache serving validation"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="output directory (default: a new temporary one)"
    )
    ap.add_argument("--backend", choices=("kvactors", "lmcache"), default="kvactors")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--bench",
        type=int,
        default=0,
        metavar="N",
        help="N warm requests per side, kvactors' op and LMCache's own CPU op alternated "
        "in one engine (ABBA)",
    )
    ap.add_argument("--no-preempt", action="store_true", help="skip the preemption engine")
    ap.add_argument(
        "--model",
        choices=("llama", "mla"),
        default="llama",
        help="llama: format 12, blocks of 32 (default); mla: a DeepSeek-V2-style model, "
        "format 3, blocks of 16",
    )
    ap.add_argument(
        "--corrupt-restore",
        action="store_true",
        help="fault knob: flip one byte of the first restored block (must FAIL)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="kvactors-serving-"))
    opts = Options(
        out=out,
        backend=a.backend,
        repeats=a.repeats,
        max_tokens=a.max_tokens,
        seed=a.seed,
        bench=a.bench,
        corrupt_restore=a.corrupt_restore,
        preempt=not a.no_preempt,
        model=a.model,
        log=sys.stderr,
    )
    report = run(opts)
    print(json.dumps(report, indent=1) if a.json else table(report))
    print(f"\nwritten: {out / 'report.json'}, {out / 'report.txt'}, {out / 'logprob-diff.png'}")
    return 0 if report["verdict"] == "PASS" else 1
