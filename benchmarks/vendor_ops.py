"""Device operations per call on the fake vendors: kvactors' op and LMCache's own ops.

    KVACTORS_FAKE_VENDOR=mlu  .venv-lmcache057/bin/python benchmarks/vendor_ops.py mlu
    KVACTORS_FAKE_VENDOR=musa .venv/bin/python            benchmarks/vendor_ops.py musa

The operands of ``kvactors bench``'s vendor part (``kvactors.cli.bench.vendor.pool``: 8
layers in one allocation, 2 chunks of 64 tokens, bf16), each op called as LMCache calls it
(the call returns once its copies are enqueued on the current stream). One call after two
warm-up calls with the same block ids, counted by the fake (``fake.counting()``) until the
device finished: for kvactors until a fence on the blocks answered, so its count holds the
one event wait with which the runtime learns that the launch finished (off the caller's
path). Cells: ``launches h2d/d2h/d2d syncs allocations``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def main(kind: str) -> int:
    import torch

    from kvactors.cli.bench._harness import baseline
    from kvactors.cli.bench.vendor import VENDOR_LAYOUTS, pool
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor

    torch.set_num_threads(1)
    theirs, ours = baseline(f"lmcache_{kind}_ops"), baseline("kvactors_vendor_op")
    if theirs is None or ours is None:
        raise SystemExit(f"needs LMCache with its {kind} ops, and the kvactors adapter")
    print(f"{'vendor':7}{'layout':9}{'dir':9}{'kvactors':20}lmcache")
    with fake_vendor(kind) as fake:
        backend: Any = kind
        if kind == "mlu":
            from kvactors.devices.mlu import MluBackend

            backend = MluBackend(layout_source="resolved")
        dev, mod = torch.device(kind, 0), getattr(torch, kind)
        with Runtime(backend, default_timeout=60.0) as rt:
            for layout in VENDOR_LAYOUTS[kind]:
                p = pool(fake, layout)
                for d in ("gather", "scatter"):
                    req = p.request(1 if d == "gather" else 0, tuple(range(0, 16, 2)))
                    cells = []
                    for who in ("kvactors", "lmcache"):
                        args = (req, p.paged, p.objects, dev)
                        call = ours(rt, *args) if who == "kvactors" else theirs(*args)
                        for _ in range(2):
                            call()
                        mod.synchronize()
                        rt.fence(range(64))
                        with fake.counting() as ops:
                            call()
                            if who == "kvactors":
                                rt.fence(range(64))
                        mod.synchronize()
                        c = ops.counts.as_dict()
                        cells.append(
                            f"{c['launches']}L {c['h2d']}/{c['d2h']}/{c['d2d']} "
                            f"{c['syncs']}S {c['allocations']}A"
                        )
                    print(f"{kind:7}{layout:9}{d:9}{cells[0]:20}{cells[1]}")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    sys.path[1:1] = [os.path.join(sys.path[0], "adapters")]
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mlu"))
