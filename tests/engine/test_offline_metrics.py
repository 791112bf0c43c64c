"""vLLM's offline ``LLM`` API in one process: kvactors' metrics are in prometheus_client's
default registry, under the names vLLM's /metrics shows in ``vllm serve``.

Runs in the engine's venv (``.venv-vllm``). One engine process (``VLLM_ENABLE_V1_MULTIPROCESSING
=0``: the engine core and the worker in the caller's process) with LMCache's MP connector and
the ``kvactors_cpu`` plugin, against an LMCache server on 127.0.0.1 that the test starts and
stops: store prompts, then the same prompts again (hits). The registry's kvactors samples must
equal the runtime's own statistics and call count, and every family must have moved.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None,
    reason="vLLM's CPU build is not installed here; run bash scripts/setup-engine.sh and use "
    ".venv-vllm/bin/python -m pytest tests/engine",
)

_ENGINE = r"""
import json, sys
from kvactors_lmcache.vllm_cpu import patch_llvmlite_lib
patch_llvmlite_lib()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prompts = json.loads(sys.argv[4])
llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
          enforce_eager=True, max_model_len=512, enable_prefix_caching=False, seed=0,
          kv_transfer_config={"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {
                                  "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                  "lmcache.mp.mp_transfer_mode": "engine_driven"}})
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
hits = 0
for _ in range(2):  # store, then hit
    for p in prompts:
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        hits += o.num_cached_tokens or 0

from prometheus_client import REGISTRY
from kvactors.observe.mirror import process_mirror
from kvactors.runtime import get_runtime

mirror = process_mirror()
mirror.update()  # the pass the background thread would make
st = get_runtime(backend="cpu", device_index=0).statistics()
samples = [[s.name, s.labels, s.value] for m in REGISTRY.collect()
           if m.name.startswith("kvactors_") for s in m.samples]
json.dump({"hits": hits, "ok": st.transfers_ok, "failed": st.transfers_failed,
           "bytes": st.bytes_moved, "samples": samples}, open(out, "w"))
"""


def _get(samples: list[Any], name: str, **labels: str) -> float | None:
    want = {"device": "cpu:0", **labels}
    for n, lab, v in samples:
        if n == name and lab == want:
            return float(v)
    return None


@pytest.mark.timeout(600)
def test_the_offline_llm_puts_kvactors_metrics_in_the_default_registry(tmp_path: Path) -> None:
    from kvactors_serving.model import TINY_LLAMA, make_model
    from kvactors_serving.procedure import engine_env
    from kvactors_serving.server import LMCacheServer
    from kvactors_serving.workload import CHUNK, make_workload

    model = make_model("llama", tmp_path / "model", seed=0)
    wl = make_workload(seed=0, vocab=int(TINY_LLAMA["vocab_size"]), max_tokens=4)
    prompts = [list(p.tokens) for p in wl.store]
    out = tmp_path / "out.json"
    with contextlib.ExitStack() as stack:
        lmc = LMCacheServer(chunk_size=CHUNK, env=engine_env(None))
        stack.callback(lmc.stop)
        lmc.wait_ready()
        env = engine_env("kvactors")
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # one process: the default registry
        proc = subprocess.run(
            [sys.executable, "-c", _ENGINE, str(model), str(lmc.port), str(out),
             json.dumps(prompts)],
            env=env, capture_output=True, text=True, timeout=540, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["samples"]
    assert res["hits"] > 0
    assert res["ok"] > 0
    assert _get(s, "kvactors_transfers_total", result="ok") == res["ok"]
    assert _get(s, "kvactors_transfers_total", result="failed") == res["failed"] == 0
    assert _get(s, "kvactors_bytes_moved_total") == res["bytes"] > 0
    lat = {"op": "transfer"}
    assert _get(s, "kvactors_call_latency_seconds_count", **lat) == res["ok"]
    assert (_get(s, "kvactors_call_latency_seconds_sum", **lat) or 0.0) > 0
