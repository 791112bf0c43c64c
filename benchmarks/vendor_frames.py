"""Python frames per warm call on the fake MLU / MUSA: kvactors' plugin op against LMCache's own
op, per layout and direction, in one process.

    KVACTORS_FAKE_VENDOR=mlu .venv-lmcache057/bin/python benchmarks/vendor_frames.py mlu
    KVACTORS_FAKE_VENDOR=musa .venv-lmcache057/bin/python benchmarks/vendor_frames.py musa

The operands of ``kvactors bench``'s vendor part (``kvactors.cli.bench.vendor.pool``: 8 layers
in one allocation, 2 chunks of 4 blocks, bf16, pinned chunks), each call with other block ids
(64 sets cycled) on the caller's current stream, returning once its copies are enqueued, as
LMCache calls it. After a warm cycle, ``--calls`` calls of each op run profiled, then are
drained (the stream synchronized in the window, every block fenced after it: the fence is the
benchmark's barrier, no call's work). Frames: Python ``call`` events in the contender's own
code (kvactors and its adapter; LMCache's package; not the bench harness's call wrapper in
``kvactors_lmcache/baseline.py``, which calls either op) on the calling thread,
where LMCache's op does all of its work and kvactors' op all but its reaper's (which drops
the lease and ends the ledger entry once the device ran the copy, off the call's path), per
call; the fake vendor's own frames are not counted. Counts, not times: the same on every run.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
from collections import Counter
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def _counter(roots: tuple[str, ...], skip: tuple[str, ...]) -> tuple[Counter[str], Any]:
    counts: Counter[str] = Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(roots) and not path.startswith(skip):
                counts["frames"] += 1

    return counts, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("mlu", "musa"))
    ap.add_argument("--calls", type=int, default=64)
    args = ap.parse_args()

    import torch

    import kvactors
    import kvactors_lmcache
    from kvactors.cli._devenv import DeviceEnv
    from kvactors.cli.bench._harness import baseline
    from kvactors.cli.bench.vendor import VENDOR_LAYOUTS, pool
    from kvactors.runtime import Runtime
    from kvactors.testing import fake_vendor

    torch.set_num_threads(1)
    theirs, ours = baseline(f"lmcache_{args.kind}_ops"), baseline("kvactors_vendor_op")
    if theirs is None or ours is None:
        sys.exit("needs LMCache with its own vendor ops (and the kvactors adapter)")
    import lmcache

    ours_roots = (
        os.path.dirname(kvactors.__file__) + os.sep,
        os.path.dirname(kvactors_lmcache.__file__) + os.sep,
    )
    harness = os.path.join(os.path.dirname(kvactors_lmcache.__file__), "baseline.py")
    skip = (os.path.dirname(kvactors.__file__) + os.sep + "testing" + os.sep, harness)
    theirs_roots = (os.path.dirname(lmcache.__file__) + os.sep,)
    out: dict[str, Any] = {"kind": args.kind, "calls": args.calls}
    with fake_vendor(args.kind) as fake:
        backend = DeviceEnv(args.kind, fake, "").backend()
        dev = torch.device(args.kind, 0)
        with Runtime(backend, default_timeout=120.0) as rt:
            for layout in VENDOR_LAYOUTS[args.kind]:
                p = pool(fake, layout)
                rng = random.Random(0)
                sets = [tuple(rng.sample(range(64), 8)) for _ in range(64)]
                for direction, d in (("gather", 1), ("scatter", 0)):
                    for name, make, roots in (
                        ("kvactors", lambda *a: ours(rt, *a), ours_roots),
                        ("lmcache", theirs, theirs_roots),
                    ):
                        call = make(p.request(d, sets[0]), p.paged, p.objects, dev, sets)
                        for _ in range(len(sets)):  # warm: plans, caches, every id set
                            call()
                        fake.synchronize()
                        rt.fence(range(64))
                        counts, prof = _counter(roots, skip)
                        gc.disable()
                        sys.setprofile(prof)
                        try:
                            for _ in range(args.calls):
                                call()
                            fake.synchronize()
                        finally:
                            sys.setprofile(None)
                            gc.enable()
                        rt.fence(range(64))
                        out[f"{layout} {direction} {name}"] = counts["frames"] / args.calls
    print(json.dumps(out))


if __name__ == "__main__":
    main()
