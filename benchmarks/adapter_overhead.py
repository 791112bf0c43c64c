"""Overhead of the LMCache adapter: LMCache's gather call path vs kvactors' kernel alone.

    .venv/bin/python benchmarks/adapter_overhead.py [--iters 30] [--layers 16]

Same process, same tensors, interleaved: each iteration times (a) LMCache's
``gather_paged_kv_to_cpu`` with the kvactors CPU plugin selected (LMCache format detection,
shape descriptor, ``resolve_device_ops`` -> kvactors ops -> runtime -> kernel), (b) the
runtime's blocking ``transfer`` alone, and (c) the kernel alone (``plan_transfer`` +
``run_fast`` on the calling thread). A gather moves 4 chunks of 256 tokens (vLLM NHD, bf16).
Reports medians and the throughput ratio kernel/adapter (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KVACTORS_LMCACHE_CPU", "1")  # before lmcache is imported
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32)  # Llama-3-8B: 32 layers, 8 KV heads
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import lmcache.lmcache_native as native
    from lmcache.v1.gpu_connector.utils import make_page_buffer_shape_desc
    from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu
    from lmcache.v1.platform import resolve_device_ops

    from kvactors.core.plans import plan_transfer
    from kvactors.kernels.fast import run_fast
    from kvactors.runtime import get_runtime
    from kvactors_lmcache import convert

    ops = resolve_device_ops("cpu")
    assert type(ops).__module__ == "kvactors_lmcache.ops", type(ops)

    nl, nh, hs, bs = args.layers, args.heads, args.head_size, args.block_size
    chunk_tokens, n_chunks = 256, 4
    bpc = chunk_tokens // bs
    nb = 2 * n_chunks * bpc
    gen = torch.Generator().manual_seed(0)
    kv = {
        f"l{i}": torch.randn((2, nb, bs, nh, hs), generator=gen).to(torch.bfloat16)
        for i in range(nl)
    }
    layers = list(kv.values())
    block_ids = torch.randperm(nb, generator=gen)[: n_chunks * bpc].tolist()
    out_a = [torch.empty((2, nl, chunk_tokens, nh * hs), dtype=torch.bfloat16) for _ in range(4)]
    out_b = [torch.empty_like(o) for o in out_a]
    out_c = [torch.empty_like(o) for o in out_a]
    fmt = native.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    sd = make_page_buffer_shape_desc(
        layers, fmt, layer_idx=0, num_layers_in_group=nl, num_blocks=nb, block_size=bs
    )
    request = convert.to_transfer_request(fmt, native.TransferDirection.D2H, block_ids,
                                          chunk_tokens, 0, sd)  # fmt: skip
    rt = get_runtime("cpu", 0)
    nbytes = sum(o.numel() * o.element_size() for o in out_a)

    def adapter() -> None:
        gather_paged_kv_to_cpu(kv, block_ids, bpc, layout_hints={"kv_layout": "NHD"}, out=out_a)

    def runtime() -> None:
        rt.transfer(request, layers, out_b)

    def kernel() -> None:
        plan = plan_transfer(request, layers, out_c, device_type="cpu", device_index=0)
        run_fast(plan, layers, out_c)

    for fn in (adapter, runtime, kernel):  # warm up (runtime start, scratch, caches)
        fn()
        fn()
    times: dict[str, list[float]] = {"adapter": [], "runtime": [], "kernel": []}
    fns = {"adapter": adapter, "runtime": runtime, "kernel": kernel}
    for i in range(args.iters):
        order = ["adapter", "runtime", "kernel"]
        order = order[i % 3 :] + order[: i % 3]  # rotate to spread cache effects
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    assert all(torch.equal(a, c) for a, c in zip(out_a, out_c, strict=True))
    assert all(torch.equal(b, c) for b, c in zip(out_b, out_c, strict=True))

    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"gather 4 x {chunk_tokens}-token chunks, NHD bf16, NL={nl} NH={nh} HS={hs} "
        f"BS={bs}: {nbytes / 2**20:.1f} MiB per gather, {args.iters} interleaved iterations, "
        f"torch threads={args.threads}"
    )
    for name in ("kernel", "runtime", "adapter"):
        ms = med[name] * 1e3
        print(f"  {name:8s} median {ms:8.3f} ms  {nbytes / med[name] / 2**30:6.2f} GiB/s"
              f"  (min {min(times[name]) * 1e3:.3f} ms)")  # fmt: skip
    ratio = med["kernel"] / med["adapter"]
    print(f"  adapter throughput / kernel throughput = {ratio:.3f}x (target >= 0.9)")
    print(f"  adapter overhead vs kernel = {(med['adapter'] - med['kernel']) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
