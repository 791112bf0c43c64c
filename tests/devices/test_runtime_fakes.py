"""Round trips through the kvactors Runtime on the fake vendors (lane threads, real async)."""

from __future__ import annotations

import pytest
import torch

from kvactors.layouts import KVFormat
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests._transfer_cases import Case

FORMATS = {"mlu": KVFormat.NL_X_TWO_NB_NH_BS_HS, "musa": KVFormat.TWO_X_NL_X_NB_BS_NH_HS}


@pytest.mark.parametrize("kind", ["mlu", "musa"])
@pytest.mark.parametrize("seed", range(3))
def test_runtime_round_trip(kind: str, seed: int) -> None:
    case = Case(fmt=FORMATS[kind], nl=2, nb=8, bs=4, nh=2, hs=8, dtype=torch.bfloat16,
                alloc="stacked", seed=seed)
    ids = [5, 1, 6, 2]
    with fake_vendor(kind, seed=seed, jitter=0.0005) as fake:
        src_cpu, _, src_backing = case.build()
        dst_cpu, ref_objs, dst_backing = case.build()
        for b in dst_backing:
            b.view(torch.uint8).zero_()
        objs = [torch.zeros(o.shape, dtype=o.dtype, pin_memory=True) for o in ref_objs]

        def dev(p: object) -> object:
            return fake.adopt(p) if isinstance(p, torch.Tensor) else [dev(x) for x in p]  # type: ignore[attr-defined]

        src, dst = dev(src_cpu), dev(dst_cpu)
        with Runtime(kind, default_timeout=30) as rt:
            rt.transfer(case.request(1, ids), src, objs)
            rt.transfer(case.request(0, ids), dst, objs)
            rt.record_completion(0, "finish", b"x")
            assert rt.drain_completions() in ([("finish", b"x")], [])
            rt.synchronize(0)
        for b in ids:
            for layer in range(case.nl):
                for p in range(2):
                    from tests._transfer_cases import block_view

                    got = fake.peek(block_view(case.fmt, dst, case.nl, layer, p, b))
                    want = fake.peek(block_view(case.fmt, src, case.nl, layer, p, b))
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        del src_backing
