"""LMCache's own engine-driven worker client against a real LMCache MP server.

Usage: e2e_client.py PORT EXPECT_MODE   (EXPECT_MODE: "inline" or "shm")

Runs in a fresh interpreter with KVACTORS_LMCACHE_CPU=1, so LMCache selects the kvactors CPU
plugin for the CPU KV tensors. For NHD, MLA and SGLang K/V lists: register, store, then for
skip 0 / one block / one chunk: lookup + prefetch, retrieve into zeroed KV, end the session;
then unregister. Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import torch

torch.set_num_threads(1)

from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (  # noqa: E402
    create_transfer_context,
)
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory  # noqa: E402
from lmcache.v1.platform import resolve_device_ops  # noqa: E402

from kvactors_lmcache import ops as kops  # noqa: E402

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
BPC = 2
CHUNK = BPC * BS  # must equal the server's --chunk-size
SRC_BLOCKS = [3, 0, 9, 12, 5, 7]
DST_BLOCKS = [1, 14, 2, 8, 11, 4]
TIMEOUT = 30.0


def make_kv(case: str, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict, EngineType]:
    def rnd(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    if case == "nhd":
        kv = {f"l{i}": rnd((2, NB, BS, NH, HS), torch.bfloat16) for i in range(NL)}
        return kv, {"kv_layout": "NHD"}, EngineType.VLLM
    if case == "mla":
        kv = {f"l{i}": rnd((NB, BS, 32), torch.float16) for i in range(NL)}
        return kv, {"kv_layout": "NHD"}, EngineType.VLLM
    if case == "fused":  # vLLM CPU attention: [NB, NH, BS, 2*HS] per layer (format 12)
        kv = {f"l{i}": rnd((NB, NH, BS, 2 * HS), torch.bfloat16) for i in range(NL)}
        return kv, {"kv_layout": "HND"}, EngineType.VLLM
    if case == "sglang":
        kv = {f"k{i}": rnd((NB * BS, NH, HS), torch.float32) for i in range(NL)}
        kv.update({f"v{i}": rnd((NB * BS, NH, HS), torch.float32) for i in range(NL)})
        return kv, {"kv_list_layout": "k_v", "tokens_per_block": BS}, EngineType.SGLANG
    raise ValueError(case)


def blocks_of(case: str, t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The raw bytes of blocks ``ids`` of one KV tensor, in ``ids`` order."""
    if case == "nhd":
        sel = t[:, ids]
    elif case in ("mla", "fused"):
        sel = t[ids]
    else:
        sel = t.view(NB, BS, NH, HS)[ids]
    return sel.contiguous().view(torch.uint8)


def other_blocks_zero(case: str, t: torch.Tensor, ids: list[int]) -> bool:
    rest = [b for b in range(NB) if b not in ids]
    return not blocks_of(case, t, rest).any()


def wait_prefetch(client: Any, rid: str) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        status = client.query_prefetch_status(rid).result(timeout=TIMEOUT)
        if status is not None:
            return int(status)
        time.sleep(0.01)  # bounded readiness poll of the server, not a race cover
    raise TimeoutError(f"prefetch {rid} did not finish in {TIMEOUT}s")


def run_case(client: Any, case: str, instance_id: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7 + instance_id)
    kv, hints, engine = make_kv(case, gen)
    model = f"kvactors-e2e-{case}-{uuid.uuid4().hex[:8]}"
    ctx = create_transfer_context(kv, instance_id=instance_id, req_client=client)
    out: dict[str, Any] = {"case": case, "ctx": type(ctx).__name__}
    ctx.register(kv, model, 1, BPC, TIMEOUT, layout_hints=hints, engine_type=engine)
    out["sub_ctx"] = type(getattr(ctx, "_engine_driven_context", None)).__name__
    tokens = list(range(1000 * instance_id, 1000 * instance_id + len(SRC_BLOCKS) * BS))
    n_chunks = len(SRC_BLOCKS) // BPC

    def key(rid: str) -> IPCCacheServerKey:
        return IPCCacheServerKey.from_token_ids(
            model, 1, 0, tokens, 0, len(tokens), request_id=rid, num_kv_readers=1
        )

    rid = f"store-{uuid.uuid4().hex}"
    out["stored"] = bool(
        ctx.submit_store(
            rid, key(rid), kv, [list(SRC_BLOCKS)], ctx.create_recorded_event(), BPC
        ).result(timeout=TIMEOUT)
    )
    client.end_session(rid).result(timeout=TIMEOUT)
    out["retrieves"] = {}
    for skip_tokens in (0, BS, CHUNK):
        rid = f"ret-{uuid.uuid4().hex}"
        k = key(rid)
        client.lookup(k.no_worker_id_version(), 1).result(timeout=TIMEOUT)
        hit = wait_prefetch(client, rid)
        dst = {name: torch.zeros_like(t) for name, t in kv.items()}
        ok = ctx.submit_retrieve(
            rid,
            k,
            dst,
            [list(DST_BLOCKS)],
            ctx.create_recorded_event(),
            BPC,
            skip_first_n_tokens=skip_tokens,
        ).result(timeout=TIMEOUT)
        client.end_session(rid).result(timeout=TIMEOUT)
        skip_blocks = skip_tokens // BS
        exact = all(
            torch.equal(
                blocks_of(case, dst[n], DST_BLOCKS[skip_blocks:]),
                blocks_of(case, kv[n], SRC_BLOCKS[skip_blocks:]),
            )
            and other_blocks_zero(case, dst[n], DST_BLOCKS[skip_blocks:])
            for n in kv
        )
        out["retrieves"][str(skip_tokens)] = {
            "hit_chunks": hit,
            "expected_chunks": n_chunks,
            "retrieved": bool(ok),
            "bit_exact": bool(exact),
        }
    fut = ctx.unregister()
    if fut is not None:
        fut.result(timeout=TIMEOUT)
    ctx.close()
    return out


def main() -> int:
    port, expect = int(sys.argv[1]), sys.argv[2]
    ops = resolve_device_ops("cpu")
    client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}")
    results: dict[str, Any] = {
        "expect": expect,
        "ops_module": type(ops).__module__,
        "ops_type": type(ops).__name__,
        "pid": os.getpid(),
        "cases": [],
    }
    try:
        for i, case in enumerate(("nhd", "mla", "sglang", "fused")):
            results["cases"].append(run_case(client, case, instance_id=100 + i))
    finally:
        client.close()
    results["plugin_calls"] = kops.transfer_counts()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
