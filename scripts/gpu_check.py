"""GPU check for kvactors' CUDA backend: ordering rules and copy bandwidth on real hardware.

Run on a machine with an NVIDIA GPU::

    python scripts/gpu_check.py [--device 0] [--mib 256] [--iters 5]

It checks, on real asynchronous streams:

1. handle 0 maps to ``torch.cuda.default_stream()`` (not ``ExternalStream(0)``), a nonzero
   handle borrows the caller's stream;
2. sync-then-publish: a marker recorded after a slow kernel is not complete before it runs,
   and ``synchronize`` makes the async D2H result readable;
3. cross-stream order: a consumer that waits on the producer's marker reads produced bytes;
4. the strided D2H copy policy gives correct bytes;
5. a kvactors gather/scatter round trip (``plan_transfer`` + ``run_fast`` through the
   backend's copy hook) is bit-exact.

Then it measures GB/s of pinned D2H/H2D raw copies against the kvactors fast kernels on a
format-1 paged cache of about ``--mib`` MiB, and prints one JSON line per measurement.
Exit status: 0 all checks passed, 1 a check failed, 2 CUDA is absent (nothing was run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


def _timed(fn: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    """Run the checks; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from kvactors.core.layouts import KVFormat, ShapeDesc
    from kvactors.core.plans import TransferRequest, plan_transfer
    from kvactors.devices import get_backend
    from kvactors.kernels.fast import ScratchCache, run_fast

    backend = get_backend("cuda")
    probe = backend.probe()
    if not probe.available:
        print(f"gpu_check: CUDA is absent, nothing checked: {probe.reason}", file=sys.stderr)
        return 2
    idx = args.device
    dev = backend.device(idx)
    failures: list[str] = []

    def check(name: str, ok: bool) -> None:
        print(json.dumps({"check": name, "ok": bool(ok)}))
        if not ok:
            failures.append(name)

    # 1. handles
    s = backend.new_stream(idx)
    check(
        "handle0_is_default", backend.stream_from_handle(0, idx) == torch.cuda.default_stream(idx)
    )
    h = backend.stream_handle(s)
    check("nonzero_handle_borrows", backend.stream_handle(backend.stream_from_handle(h, idx)) == h)

    # 2. sync-then-publish on a slow kernel
    backend.bind_thread(idx, s)
    big = torch.randn(4096, 4096, device=dev)
    host = torch.zeros(4096, dtype=torch.float32).pin_memory()

    def slow() -> None:
        x = big
        for _ in range(20):
            x = x @ big
        backend.copy_(host, x[0])

    backend.launch(s, slow)
    marker = backend.record_marker(s)
    early = marker.query()
    backend.synchronize(s)
    check("marker_not_early", not early or marker.query())
    check("marker_complete_after_sync", marker.query())

    # 3. producer/consumer across streams
    prod, cons = backend.new_stream(idx), backend.new_stream(idx)
    buf = torch.zeros(1 << 22, device=dev)
    out = torch.empty(1 << 22, dtype=torch.float32).pin_memory()
    backend.launch(prod, lambda: buf.fill_(7.0))
    m = backend.record_marker(prod)
    ev = torch.cuda.Event()
    ev.record(prod)  # type: ignore[arg-type]

    def consume() -> None:
        torch.cuda.current_stream().wait_event(ev)
        backend.copy_(out, buf)

    backend.launch(cons, consume)
    backend.synchronize(cons)
    m.synchronize()
    check("consumer_waits_for_producer", bool((out == 7.0).all()))

    # 4. strided D2H
    src = torch.arange(64 * 64, dtype=torch.float32, device=dev).view(64, 64)
    wide = torch.zeros(64, 128, dtype=torch.float32).pin_memory()
    backend.launch(s, lambda: backend.copy_(wide[:, :64], src))
    backend.synchronize(s)
    check("strided_d2h_exact", torch.equal(wide[:, :64], src.cpu()))

    # 5. kvactors round trip + bandwidth
    nl, bs, nh, hs = 8, 16, 8, 128
    per_block = 2 * bs * nh * hs * 2
    nb = max(64, (args.mib << 20) // (nl * per_block))
    bpo = 16
    shape = ShapeDesc(
        kv_size=2, nl=nl, nb=nb, bs=bs, nh=nh, hs=hs, element_size=2, dtype="bfloat16"
    )
    paged = [torch.randn(2, nb, bs, nh, hs, device=dev).to(torch.bfloat16) for _ in range(nl)]
    back = [torch.zeros_like(p) for p in paged]
    n_obj = nb // bpo
    objs = [
        torch.empty(2, nl, bpo * bs, nh * hs, dtype=torch.bfloat16).pin_memory()
        for _ in range(n_obj)
    ]
    ids = tuple(range(n_obj * bpo))

    def req(direction: int) -> TransferRequest:
        return TransferRequest(
            fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
            direction=direction,
            block_ids=ids,
            chunk_size=bpo * bs,
            shape=shape,
        )

    scratch = ScratchCache()
    d2h = plan_transfer(req(1), paged, objs, device_type="cuda", device_index=idx)
    h2d = plan_transfer(req(0), back, objs, device_type="cuda", device_index=idx)
    backend.launch(s, lambda: run_fast(d2h, paged, objs, copy=backend.copy_, scratch=scratch))
    backend.launch(s, lambda: run_fast(h2d, back, objs, copy=backend.copy_, scratch=scratch))
    backend.synchronize(s)
    exact = all(torch.equal(a, b) for a, b in zip(paged, back, strict=True))
    check("kvactors_round_trip_exact", exact)

    nbytes = d2h.nbytes
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def sync() -> None:
        backend.synchronize(s)

    rows = {
        "raw_d2h": lambda: backend.launch(s, lambda: flat_host.copy_(flat_dev, non_blocking=True)),
        "raw_h2d": lambda: backend.launch(s, lambda: flat_dev.copy_(flat_host, non_blocking=True)),
        "kvactors_d2h": lambda: backend.launch(
            s, lambda: run_fast(d2h, paged, objs, copy=backend.copy_, scratch=scratch)
        ),
        "kvactors_h2d": lambda: backend.launch(
            s, lambda: run_fast(h2d, back, objs, copy=backend.copy_, scratch=scratch)
        ),
    }
    for name, fn in rows.items():
        sec = _timed(fn, sync, args.iters)
        print(
            json.dumps(
                {
                    "bench": name,
                    "bytes": nbytes,
                    "seconds": round(sec, 6),
                    "GBps": round(nbytes / sec / 1e9, 2),
                }
            )
        )
    if failures:
        print(f"gpu_check: FAILED {failures}", file=sys.stderr)
        return 1
    print("gpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
