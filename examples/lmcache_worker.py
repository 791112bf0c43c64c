"""Embedding the kvactors runtime in an LMCache-style worker process (no lmcache needed).

LMCache's multiprocess worker calls its device ops from several threads at once: up to four
commit threads run stores (D2H gathers of paged KV into host chunks), the request thread runs
retrieves (H2D scatters), and a periodic dispatcher thread drains completion records every
5 ms (``drain_recorded_completions``). This example builds that shape around one
:class:`kvactors.runtime.Runtime`:

* ``KVWorker.store`` (called from 4 commit threads): gather, then ``record_completion`` on the
  stream; the record becomes drainable only after everything earlier on the stream ran;
* ``KVWorker.retrieve`` (the request thread): scatter committed chunks into fresh blocks;
* a dispatcher thread drains completions and commits each store *when its record arrives*,
  checking the chunk's bytes at that moment and that every commit thread's records arrive
  in the order that thread recorded them. (``transfer`` returns only once the gather is
  complete, so this shows the embedding, not the publish-after-sync rule; that rule is
  tested against the actors in the test suite.)

Usage::

    python examples/lmcache_worker.py [--device cpu|mlu|musa] [--stores 64]

Exits 0 when every store was committed bit-exact, in order, and every retrieve round-tripped.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices import get_backend
from kvactors.devices.mlu import MluBackend
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

NL, NB, BS, NH, HS = 2, 64, 4, 2, 16
BPC = 2
CHUNK = BPC * BS
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS


class StoreDone(msgspec.Struct, frozen=True):
    """The completion payload (msgpack on the wire, as LMCache's are)."""

    thread: int
    seq: int
    chunk: int


class KVWorker:
    """Owns the runtime and the paged KV of one engine worker; thread-safe like DeviceOps."""

    def __init__(self, device: str, paged: list[torch.Tensor], *, pinned: bool) -> None:
        # This worker allocates real NHD memory: on MLU declare format 1 "resolved" (vLLM-MLU
        # itself allocates HND; see docs/guides/mlu.md).
        backend = MluBackend(layout_source="resolved") if device == "mlu" else device
        self.rt = Runtime(backend, default_timeout=30).start()
        self.paged = paged
        self.pinned = pinned
        self._encode = msgspec.msgpack.Encoder().encode

    def _request(self, direction: Direction, ids: list[int]) -> TransferRequest:
        shape = ShapeDesc(
            kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
        )
        return TransferRequest(
            fmt=int(FMT),
            direction=int(direction),
            block_ids=tuple(ids),
            chunk_size=CHUNK,
            shape=shape,
        )

    def new_chunk(self) -> torch.Tensor:
        """A host chunk (LMCache's pooled pinned staging buffer)."""
        return torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.bfloat16, pin_memory=self.pinned)

    def store(self, ids: list[int], obj: torch.Tensor, done: StoreDone) -> None:
        """Gather ``ids`` into ``obj``, then record the completion on the default stream."""
        self.rt.transfer(self._request(Direction.D2H, ids), self.paged, [obj])
        self.rt.record_completion(0, "store_done", self._encode(done))

    def retrieve(self, ids: list[int], objs: list[torch.Tensor]) -> None:
        """Scatter committed chunks into blocks ``ids``."""
        self.rt.transfer(self._request(Direction.H2D, ids), self.paged, objs)

    def drain(self) -> list[tuple[str, bytes]]:
        """LMCache's ``drain_recorded_completions``."""
        return self.rt.drain_completions()

    def close(self) -> None:
        """Bounded shutdown (LMCache's ``close``)."""
        self.rt.close()


@contextlib.contextmanager
def device_kv(kind: str) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor], bool, str]]:
    """(paged KV for the runtime, its host alias for checking, pinned?, description)."""
    g = torch.Generator().manual_seed(0)
    host = torch.randn(NL, 2, NB, BS, NH, HS, generator=g).to(torch.bfloat16)
    layers = list(host.unbind(0))
    if kind == "cpu":
        yield layers, layers, False, "cpu"
    elif get_backend(kind).probe().available:  # pragma: no cover - needs the hardware
        dev = [t.to(f"{kind}:0") for t in layers]
        yield dev, layers, True, f"{kind}:0 hardware"
    else:
        with fake_vendor(kind, seed=1, jitter=0.0005) as fake:
            yield [fake.adopt(t) for t in layers], layers, True, f"fake {kind}"


def expected_chunk(host: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The bytes a gather of ``ids`` must produce (token-major host chunk)."""
    blocks = torch.stack([torch.stack([t[:, b] for t in host], 1) for b in ids], 2)
    # blocks: [2, NL, n, BS, NH, HS] -> [2, NL, n*BS, NH*HS]
    return blocks.reshape(2, NL, len(ids) * BS, NH * HS)


def main(argv: list[str] | None = None) -> int:
    """Run 4 commit threads, a dispatcher and a request thread against one worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "mlu", "musa"), default="cpu")
    ap.add_argument("--stores", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    problems: list[str] = []
    committed: dict[int, torch.Tensor] = {}
    with device_kv(args.device) as (paged, host, pinned, desc):
        worker = KVWorker(args.device, paged, pinned=pinned)
        pending: dict[int, tuple[list[int], torch.Tensor]] = {}
        lock = threading.Lock()
        last_seq: dict[int, int] = {}
        stop = threading.Event()
        decode = msgspec.msgpack.Decoder(StoreDone).decode
        n_threads = 4

        def on_record(kind: str, payload: bytes) -> None:
            rec = decode(payload)
            if rec.seq != last_seq.get(rec.thread, -1) + 1:
                problems.append(f"thread {rec.thread}: record {rec.seq} out of order")
            last_seq[rec.thread] = rec.seq
            with lock:
                ids, obj = pending.pop(rec.chunk)
            if not torch.equal(obj.view(torch.int16), expected_chunk(host, ids).view(torch.int16)):
                problems.append(f"chunk {rec.chunk}: record drained before its bytes landed")
            committed[rec.chunk] = obj  # commit_store: visible to lookups from now on

        def dispatcher() -> None:  # LMCache's DeviceHostFuncDispatcher: drain every 5 ms
            while not stop.is_set():
                for kind, payload in worker.drain():
                    on_record(kind, payload)
                time.sleep(0.005)
            for kind, payload in worker.drain():
                on_record(kind, payload)

        def commit_thread(t: int) -> None:
            for seq in range(args.stores // n_threads):
                chunk = t * 1000 + seq
                first = (t * 16 + 2 * seq) % (NB - 1)
                ids = [first, (first + 1) % NB]
                obj = worker.new_chunk()
                with lock:
                    pending[chunk] = (ids, obj)
                worker.store(ids, obj, StoreDone(thread=t, seq=seq, chunk=chunk))

        t0 = time.perf_counter()
        drainer = threading.Thread(target=dispatcher, name="dispatcher")
        drainer.start()
        threads = [threading.Thread(target=commit_thread, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        worker.rt.synchronize(0)
        stop.set()
        drainer.join()
        # The request thread: load two committed chunks into fresh blocks and compare.
        chunks = sorted(committed)[:2]
        dst = [NB - 4, NB - 3, NB - 2, NB - 1]
        worker.retrieve(dst, [committed[c] for c in chunks])
        worker.rt.synchronize(0)
        for i, c in enumerate(chunks):
            got = torch.cat(
                [torch.stack([t[:, b] for t in host], 1) for b in dst[2 * i : 2 * i + 2]], 2
            ).reshape(2, NL, CHUNK, NH * HS)
            if not torch.equal(got.view(torch.int16), committed[c].view(torch.int16)):
                problems.append(f"retrieve of chunk {c} does not round-trip")
        stats = worker.rt.statistics()
        worker.close()
        wall = time.perf_counter() - t0
    n_stores = n_threads * (args.stores // n_threads)
    print(f"kvactors LMCache-style worker on {desc}")
    print(
        f"  commit threads: {n_threads}, stores: {n_stores}, committed via drained records: "
        f"{len(committed)}, never drained: {len(pending)}"
    )
    print(
        f"  transfers ok/failed: {stats.transfers_ok}/{stats.transfers_failed}, "
        f"bytes moved: {stats.bytes_moved}, wall: {wall:.2f} s"
    )
    if len(committed) != n_stores or pending:
        problems.append("not every store was committed")
    for p in problems[:10]:
        print(f"  PROBLEM: {p}")
    print("  RESULT:", "OK" if not problems else f"FAILED ({len(problems)} problems)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
