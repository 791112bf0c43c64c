"""Plugin vs LMCache's built-in CPU ops through LMCache's gather/scatter callers (bit-exact).

Run in a fresh interpreter with KVACTORS_LMCACHE_CPU=1 (LMCache caches device detection at
import). Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch

torch.set_num_threads(1)

import lmcache.v1.multiprocess.transfer_context.base as tc_base  # noqa: E402
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.platform import resolve_device_ops  # noqa: E402
from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps  # noqa: E402

from kvactors_lmcache import ops as kops  # noqa: E402

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
BPC = 2  # blocks per chunk
BLOCKS = [3, 0, 9, 12, 5, 7]  # three chunks, out of order on purpose


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_kv(case: str, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    if case == "nhd":
        return {
            "kv": {f"l{i}": _rand((2, NB, BS, NH, HS), dtype, gen) for i in range(NL)},
            "hints": {"kv_layout": "NHD"},
            "engine": EngineType.VLLM,
        }
    if case == "hnd":
        return {
            "kv": {f"l{i}": _rand((2, NB, NH, BS, HS), dtype, gen) for i in range(NL)},
            "hints": {"kv_layout": "HND"},
            "engine": EngineType.VLLM,
        }
    if case == "mla":
        return {
            "kv": {f"l{i}": _rand((NB, BS, HS * 4), dtype, gen) for i in range(NL)},
            "hints": {"kv_layout": "NHD"},
            "engine": EngineType.VLLM,
        }
    if case == "mla_padded":
        # A dim-0-padded MLA pool (LMCache 0.5.7 passes block_stride_elems = stride(0)).
        row = BS * HS * 4
        pools = [_rand((NB, row + 40), dtype, gen) for _ in range(NL)]
        return {
            "kv": {
                f"l{i}": p.as_strided((NB, BS, HS * 4), (row + 40, HS * 4, 1))
                for i, p in enumerate(pools)
            },
            "hints": {"kv_layout": "NHD"},
            "engine": EngineType.VLLM,
        }
    if case in ("fused_hnd", "fused_nhd"):
        # vLLM's blocks-first fused K/V (format 12 HND: its CPU attention; 13 NHD): per layer
        # [NB, NH, BS, 2*HS] or [NB, BS, NH, 2*HS], each head's K row then its V row.
        mid = (NH, BS) if case == "fused_hnd" else (BS, NH)
        return {
            "kv": {f"l{i}": _rand((NB, *mid, 2 * HS), dtype, gen) for i in range(NL)},
            "hints": {"kv_layout": "HND" if case == "fused_hnd" else "NHD"},
            "engine": EngineType.VLLM,
        }
    if case == "fused_hnd_blocks_first":
        # One [NB, NL, NH, BS, 2*HS] allocation seen per layer (vLLM's BLHNC views): stride(0)
        # spans every layer's block, which LMCache 0.5.7 passes as block_stride_elems.
        pool = _rand((NB, NL, NH, BS, 2 * HS), dtype, gen)
        return {
            "kv": {f"l{i}": pool[:, i] for i in range(NL)},
            "hints": {"kv_layout": "BLHNC"},
            "engine": EngineType.VLLM,
        }
    if case == "sglang":
        kv = {f"k{i}": _rand((NB * BS, NH, HS), dtype, gen) for i in range(NL)}
        kv.update({f"v{i}": _rand((NB * BS, NH, HS), dtype, gen) for i in range(NL)})
        return {
            "kv": kv,
            "hints": {"kv_list_layout": "k_v", "tokens_per_block": BS},
            "engine": EngineType.SGLANG,
        }
    raise ValueError(case)


def _format_of(kv: dict[str, torch.Tensor], hints: dict[str, Any], engine: Any) -> str:
    """The EngineKVFormat LMCache's detector reports for ``kv`` (what the op is called with)."""
    from lmcache.v1.gpu_connector.utils import normalize_kv_and_discover_format

    fmt, _ = normalize_kv_and_discover_format(list(kv.values()), engine, layout_hints=hints)
    return str(fmt.name)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def zeros_like_strided(t: torch.Tensor) -> torch.Tensor:
    base = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def run_case(case: str, dtype: torch.dtype, builtin: Any, window: int | None = None) -> dict:
    gen = torch.Generator().manual_seed(1234)
    spec = make_kv(case, dtype, gen)
    kv, hints, engine = spec["kv"], spec["hints"], spec["engine"]
    real_resolve = tc_base.resolve_device_ops
    # Sliding-window groups (LMCache 0.5.7): the op sees window-sized chunks and skips.
    extra = {} if window is None else {"blocks_per_window": window}

    def gather(use_builtin: bool, src: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        tc_base.resolve_device_ops = (lambda _dt: builtin) if use_builtin else real_resolve
        try:
            return tc_base.gather_paged_kv_to_cpu(
                src if src is not None else kv,
                list(BLOCKS),
                BPC,
                layout_hints=hints,
                engine_type=engine,
                **extra,
            )
        finally:
            tc_base.resolve_device_ops = real_resolve

    def scatter(chunks: list[torch.Tensor], skip_tokens: int, use_builtin: bool) -> dict:
        dst = {k: zeros_like_strided(v) for k, v in kv.items()}
        tc_base.resolve_device_ops = (lambda _dt: builtin) if use_builtin else real_resolve
        try:
            tc_base.scatter_cpu_to_paged_kv(
                dst,
                list(BLOCKS),
                chunks,
                BPC,
                skip_first_n_tokens=skip_tokens,
                layout_hints=hints,
                engine_type=engine,
                **extra,
            )
        finally:
            tc_base.resolve_device_ops = real_resolve
        return dst

    before = kops.transfer_counts()
    got = gather(False)
    ref = gather(True)
    gather_ok = len(got) == len(ref) and all(
        torch.equal(bits(a), bits(b)) for a, b in zip(got, ref, strict=True)
    )
    scatter_ok = {}
    for skip in (0, BS, BPC * BS):
        d_p = scatter(ref, skip, False)
        d_b = scatter(ref, skip, True)
        same = all(torch.equal(bits(d_p[k]), bits(d_b[k])) for k in kv)
        # Round trip: non-skipped target blocks equal the source, the rest stays zero.
        scatter_ok[str(skip)] = bool(same)
    # Round trip through the plugin alone: scatter into zeros, gather again (bit-exact), then
    # scatter zero chunks over the same blocks: nothing outside the target blocks was written.
    roundtrip = scatter(got, 0, False)
    again = gather(False, roundtrip)
    rt_ok = all(torch.equal(bits(a), bits(b)) for a, b in zip(got, again, strict=True))
    tc_base.scatter_cpu_to_paged_kv(
        roundtrip,
        list(BLOCKS),
        [torch.zeros_like(c) for c in got],
        BPC,
        layout_hints=hints,
        engine_type=engine,
        **extra,
    )
    untouched_ok = all(not bits(v).any() for v in roundtrip.values())
    after = kops.transfer_counts()
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "case": case if window is None else f"{case}_window{window}",
        "dtype": str(dtype),
        "chunk_shape": list(got[0].shape) if got else [],
        "format": _format_of(kv, hints, engine),
        "gather_bit_exact": bool(gather_ok),
        "scatter_bit_exact": scatter_ok,
        "roundtrip": bool(rt_ok),
        "untouched": bool(untouched_ok),
        "plugin_calls": served,
    }


def main() -> int:
    ops = resolve_device_ops("cpu")
    builtin = CpuDeviceOps()

    results = {
        "ops_type": f"{type(ops).__module__}.{type(ops).__qualname__}",
        "cases": [],
    }
    cases = [
        ("nhd", torch.bfloat16),
        ("hnd", torch.float16),
        ("mla", torch.float32),
        ("sglang", torch.bfloat16),
    ]
    cases.append(("mla_padded", torch.bfloat16))
    cases += [
        ("fused_hnd", torch.bfloat16),
        ("fused_nhd", torch.float16),
        ("fused_hnd_blocks_first", torch.bfloat16),
    ]
    for case, dtype in cases:
        results["cases"].append(run_case(case, dtype, builtin))  # type: ignore[attr-defined]
    if "blocks_per_window" in inspect.signature(tc_base.gather_paged_kv_to_cpu).parameters:
        results["cases"].append(run_case("nhd", torch.bfloat16, builtin, window=1))  # type: ignore[attr-defined]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
