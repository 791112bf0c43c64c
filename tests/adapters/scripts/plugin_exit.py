"""Use the kvactors_mlu plugin on the fake vendor as LMCache's MluDeviceOps would (the calling
thread's current stream is a borrowed, non-default one), then exit without closing anything.

Run with KVACTORS_FAKE_VENDOR=mlu. Prints ``ok``; the parent test reads stderr for asyncio's
"Task was destroyed but it is pending!" (interpreter exit must stop every actor).
"""

from __future__ import annotations

import os

os.environ.setdefault("KVACTORS_MLU_LAYOUT_SOURCE", "resolved")  # the engine resolved NHD

import lmcache.lmcache_native as native
import torch

from kvactors.testing import fake_vendor

NL, NB, BS, NH, HS = 2, 8, 4, 2, 8
CHUNK = 2 * BS


INSTALLED = fake_vendor("mlu", seed=1)  # kept installed until the process ends


def main() -> None:
    fake = INSTALLED.__enter__()
    from kvactors_lmcache.ops import KvactorsMluOps

    sd = native.PageBufferShapeDesc()
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = 2, NL, NB, BS, NH, HS
    sd.element_size, sd.dtype = 2, torch.bfloat16
    layers = [fake.adopt(torch.randn(2, NB, BS, NH, HS).to(torch.bfloat16)) for _ in range(NL)]
    chunk = torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.bfloat16)
    ops = KvactorsMluOps()
    stream = fake.Stream()
    with fake.stream(stream):
        ops.multi_layer_block_kv_transfer(
            layers, [chunk], [1, 2], "mlu:0", native.TransferDirection.D2H, sd,
            CHUNK, native.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, 0,
        )  # fmt: skip
        handle = int(getattr(stream, "mlu_stream"))  # noqa: B009 (the vendor's own attribute)
        ops.record_completion_on_stream(handle, "stored", b"1")
    stream.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
