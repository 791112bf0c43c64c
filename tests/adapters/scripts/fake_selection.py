"""Plugin selection and a transfer under kvactors' fake torch_mlu / torch_musa.

Usage: fake_selection.py KIND   (KIND: mlu or musa; LMCACHE_DEVICE_BACKEND set by the caller)

The fake vendor module is installed *before* ``import lmcache`` so that LMCache's detection
sees it. Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)

from kvactors.testing import fake_vendor  # noqa: E402

NL, NB, BS, NH, HS = 2, 8, 4, 2, 8
BPC = 2
BLOCKS = [5, 1, 6, 2]


def main(kind: str) -> dict[str, object]:
    out: dict[str, object] = {"kind": kind}
    with fake_vendor(kind, lazy=True) as fake:
        import lmcache
        import lmcache.lmcache_native as native
        from lmcache.v1.platform import resolve_device_ops
        from lmcache.v1.platform._device_detect import current_device_spec
        from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as oracle

        ops = resolve_device_ops(kind)
        out["torch_device_type"] = lmcache.torch_device_type
        out["spec"] = current_device_spec().backend_name
        out["ops"] = f"{type(ops).__module__}.{type(ops).__qualname__}"
        out["global_ops"] = type(lmcache.device_ops).__qualname__

        gen = torch.Generator().manual_seed(11)
        host_layers = [
            torch.randn((2, NB, BS, NH, HS), generator=gen).to(torch.bfloat16) for _ in range(NL)
        ]
        dev_layers = [fake.to_device(t) for t in host_layers]
        sd = native.PageBufferShapeDesc()
        fields = {"kv_size": 2, "nl": NL, "nb": NB, "bs": BS, "nh": NH, "hs": HS}
        for name, value in fields.items():
            setattr(sd, name, value)
        sd.element_size = 2
        sd.dtype = torch.bfloat16
        chunk = BPC * BS
        n_obj = len(BLOCKS) // BPC
        fmt = native.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS

        got = [torch.zeros((2, NL, chunk, NH * HS), dtype=torch.bfloat16) for _ in range(n_obj)]
        ref = [torch.zeros_like(o) for o in got]
        device = dev_layers[0].device
        ops.multi_layer_block_kv_transfer(
            dev_layers, got, list(BLOCKS), device, native.TransferDirection.D2H, sd, chunk, fmt, 0
        )
        oracle(
            host_layers, ref, list(BLOCKS), torch.device("cpu"),
            native.TransferDirection.D2H, sd, chunk, fmt, 0,
        )  # fmt: skip
        out["d2h_bit_exact"] = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(got, ref, strict=True)
        )
        # H2D into zeroed device memory; complete on return (then read back through the fake).
        dst = [fake.to_device(torch.zeros_like(t)) for t in host_layers]
        ops.multi_layer_block_kv_transfer(
            dst, ref, list(BLOCKS), device, native.TransferDirection.H2D, sd, chunk, fmt, 0
        )
        back = [fake.to_host(t) if hasattr(fake, "to_host") else t.cpu() for t in dst]
        exact = True
        for layer in range(NL):
            for b in range(NB):
                want = (
                    host_layers[layer][:, b]
                    if b in BLOCKS
                    else torch.zeros_like(host_layers[layer][:, b])
                )
                exact &= torch.equal(back[layer][:, b].view(torch.int16), want.view(torch.int16))
        out["h2d_bit_exact"] = bool(exact)
        try:
            ops.multi_layer_block_kv_transfer(
                dev_layers, [o.data_ptr() for o in got], list(BLOCKS), device,
                native.TransferDirection.D2H, sd, chunk, fmt, 0,
            )  # fmt: skip
            out["pointer_mode"] = "accepted"
        except TypeError as exc:
            out["pointer_mode"] = f"TypeError: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
