"""KV across processes through CPU shared memory, and what happens when either side dies.

An engine *worker* allocates its paged KV in named shared-memory segments and exports them:
only the segment name and the tensor metadata cross the process boundary (an ``IPCHandle``),
never a pointer. A cache *server* opens the handles with ``Runtime.open_ipc`` into a context,
gathers (stores) and scatters (retrieves) through them, and closes the context with
``Runtime.close_ipc_context``, which synchronizes the streams first, then drops the views,
then unmaps. Three runs:

1. **normal**: the worker is this process, the server a child. The server stores two chunks,
   retrieves one into other blocks of the worker's KV, closes after the stream sync and exits;
   the worker checks every byte.
2. **server killed** (SIGKILL while it holds the mappings): the worker still unlinks its
   segments; nothing is left in /dev/shm and the worker's fds and mappings are back to where
   they were.
3. **worker killed** (SIGKILL while this process, now the server, holds its mappings): the
   mappings stay valid (the kernel keeps the pages while mapped), transfers through them still
   work, and closing the context unmaps them: fds and mappings return to the baseline.
   The dead worker never unlinked its segments; the example removes the names it was given.

Usage::

    python examples/ipc_cross_process.py

Exits 0 when all three runs behave as described.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices.cpu import CpuBackend
from kvactors.runtime import Runtime

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvactors.devices.base import IPCHandle
    from kvactors.devices.cpu.shm import SharedTensor

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
CHUNK = 2 * BS
CTX = 1


def shm_mappings() -> int:
    """Lines of /proc/self/maps mapping a /dev/shm segment."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum("/dev/shm/" in line for line in f)


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def request(direction: Direction, ids: list[int]) -> TransferRequest:
    """A request over the shared paged KV (bfloat16, NHD per layer)."""
    shape = ShapeDesc(
        kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS, element_size=2, dtype="bfloat16"
    )
    return TransferRequest(
        fmt=int(KVFormat.NL_X_TWO_NB_BS_NH_HS),
        direction=int(direction),
        block_ids=tuple(ids),
        chunk_size=CHUNK,
        shape=shape,
    )


def export_kv(backend: CpuBackend, seed: int) -> tuple[SharedTensor, list[IPCHandle]]:
    """Allocate the paged KV in one shared segment, fill it, export one handle per layer."""
    shared = backend.alloc_shared((NL, 2, NB, BS, NH, HS), torch.bfloat16)
    assert shared.tensor is not None
    g = torch.Generator().manual_seed(seed)
    shared.tensor.copy_(torch.randn(shared.tensor.shape, generator=g).to(torch.bfloat16))
    return shared, [backend.ipc_export(shared.tensor[layer]) for layer in range(NL)]


def to_wire(t: torch.Tensor) -> tuple[bytes, tuple[int, ...]]:
    """Tensor bytes for a pipe (torch's own pickling would share memory via the sender)."""
    return t.contiguous().view(torch.int16).numpy().tobytes(), tuple(t.shape)


def from_wire(w: tuple[bytes, tuple[int, ...]]) -> torch.Tensor:
    """The inverse of :func:`to_wire` (bfloat16)."""
    data, shape = w
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(shape)


def chunk_of(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Host-chunk bytes of blocks ``ids`` of ``kv`` (``[NL, 2, NB, BS, NH, HS]``)."""
    blocks = kv[:, :, ids].permute(1, 0, 2, 3, 4, 5)  # [2, NL, n, BS, NH, HS]
    return blocks.reshape(2, NL, len(ids) * BS, NH * HS)


# ---- the server (a child in runs 1 and 2) --------------------------------------------------


def server_main(conn: Connection, handles: list[IPCHandle], linger: bool) -> None:
    """Open the worker's KV, store two chunks, retrieve one, close after the sync, report."""
    torch.set_num_threads(1)
    report: dict[str, Any] = {"maps_before": shm_mappings(), "fds_before": open_fds()}
    with Runtime("cpu") as rt:
        paged = [rt.open_ipc(h, context_id=CTX) for h in handles]
        report["maps_open"] = shm_mappings()
        chunks = [torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.bfloat16) for _ in range(2)]
        rt.transfer(request(Direction.D2H, [1, 5, 9, 3]), paged, chunks)
        rt.transfer(request(Direction.H2D, [12, 13]), paged, chunks[:1])
        report["chunks"] = [to_wire(c) for c in chunks]
        if linger:
            conn.send(report)
            conn.recv()  # killed here, mappings held
            return
        del paged
        closed = rt.close_ipc_context(CTX, stream_handles=(0,))
        report["owners_closed"] = closed.owners_closed
        report["maps_after"] = shm_mappings()
    report["fds_after"] = open_fds()
    conn.send(report)


def worker_child(conn: Connection) -> None:
    """Run 3's worker: export the KV, hand over the handles, wait to be killed."""
    shared, handles = export_kv(CpuBackend(), seed=3)
    assert shared.tensor is not None
    conn.send((handles, to_wire(shared.tensor)))
    conn.recv()  # killed here, without unlinking


# ---- orchestration -----------------------------------------------------------------------


def _spawn(target: Any, *args: Any) -> tuple[Any, Connection]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def run_normal(problems: list[str]) -> None:
    """Run 1: the server stores and retrieves, then closes after the stream sync."""
    backend = CpuBackend()
    maps0, fds0 = shm_mappings(), open_fds()
    shared, handles = export_kv(backend, seed=1)
    assert shared.tensor is not None
    kv_before = shared.tensor.clone()
    proc, conn = _spawn(server_main, handles, False)
    rep = conn.recv()
    proc.join(30)
    conn.close()
    proc.close()
    kv = shared.tensor
    want0, want1 = chunk_of(kv_before, [1, 5]), chunk_of(kv_before, [9, 3])
    got = [from_wire(w) for w in rep["chunks"]]
    if not (torch.equal(got[0], want0) and torch.equal(got[1], want1)):
        problems.append("normal: stored chunks differ from the worker's KV")
    if not torch.equal(chunk_of(kv, [12, 13]), want0):
        problems.append("normal: the retrieve did not land in the worker's KV")
    untouched = [b for b in range(NB) if b not in (12, 13)]
    if not torch.equal(kv[:, :, untouched], kv_before[:, :, untouched]):
        problems.append("normal: the retrieve touched other blocks")
    if rep["owners_closed"] != NL or rep["maps_after"] != rep["maps_before"]:
        problems.append(f"normal: server did not unmap everything: {rep}")
    name = shared.name
    del kv
    shared.close()
    print(
        "run 1 (normal): server mapped",
        rep["maps_open"] - rep["maps_before"],
        "segment views, closed",
        rep["owners_closed"],
        "owners after the stream sync;",
        f"server fds {rep['fds_before']} -> {rep['fds_after']}, /dev/shm mappings "
        f"{rep['maps_before']} -> {rep['maps_open']} -> {rep['maps_after']}; worker fds "
        f"{fds0} -> {open_fds()}, mappings {maps0} -> {shm_mappings()}, segment left: "
        f"{os.path.exists('/dev/shm/' + name)}",
    )
    if os.path.exists("/dev/shm/" + name) or shm_mappings() != maps0 or open_fds() != fds0:
        problems.append("normal: the worker leaked a segment, mapping or fd")


def run_server_killed(problems: list[str]) -> None:
    """Run 2: SIGKILL the server while it holds the mappings; the worker still cleans up."""
    backend = CpuBackend()
    maps0, fds0 = shm_mappings(), open_fds()
    shared, handles = export_kv(backend, seed=2)
    proc, conn = _spawn(server_main, handles, True)
    rep = conn.recv()  # the server has stored and retrieved, and holds its mappings
    _kill(proc)
    code = proc.exitcode
    conn.close()
    proc.close()
    name = shared.name
    shared.close()  # the exporter alone unlinks
    left = os.path.exists("/dev/shm/" + name)
    print(
        f"run 2 (server killed, exit {code}): the server held "
        f"{rep['maps_open'] - rep['maps_before']} mappings; worker unlinked its segment "
        f"(left in /dev/shm: {left}); worker fds {fds0} -> {open_fds()}, mappings {maps0} -> "
        f"{shm_mappings()}"
    )
    if left or shm_mappings() != maps0 or open_fds() != fds0:
        problems.append("server killed: the worker leaked a segment, mapping or fd")


def run_worker_killed(problems: list[str]) -> None:
    """Run 3: SIGKILL the worker while this process (the server) holds its mappings."""
    with Runtime("cpu") as rt:
        rt.ping()
        maps0, fds0 = shm_mappings(), open_fds()
        proc, conn = _spawn(worker_child)
        handles, wire = conn.recv()
        kv_copy = from_wire(wire)
        paged = [rt.open_ipc(h, context_id=CTX) for h in handles]
        maps_open = shm_mappings()
        _kill(proc)
        code = proc.exitcode
        conn.close()
        proc.close()
        # The pages outlive their exporter while mapped: store and retrieve still work.
        chunk = [torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.bfloat16)]
        rt.transfer(request(Direction.D2H, [2, 7]), paged, chunk)
        ok = torch.equal(chunk[0], chunk_of(kv_copy, [2, 7]))
        rt.transfer(request(Direction.H2D, [0, 1]), paged, chunk)
        landed = torch.equal(torch.stack(paged, 0)[:, :, [0, 1]], kv_copy[:, :, [2, 7]])
        del paged
        closed = rt.close_ipc_context(CTX, stream_handles=(0,))
        maps_after, fds_after = shm_mappings(), open_fds()
        for h in handles:  # the worker died before unlinking its segment: do it for it
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/shm/" + h.name)
                # ...and tell the (shared) resource tracker, which the dead worker could not.
                resource_tracker.unregister("/" + h.name, "shared_memory")
    print(
        f"run 3 (worker killed, exit {code}): mappings stayed valid (store ok: {ok}, "
        f"retrieve ok: {landed}); close_ipc_context closed {closed.owners_closed} owners; "
        f"server fds {fds0} -> {fds_after}, mappings {maps0} -> {maps_open} -> {maps_after}"
    )
    if not (ok and landed):
        problems.append("worker killed: transfers through surviving mappings failed")
    if closed.owners_closed != NL or maps_after != maps0 or fds_after != fds0:
        problems.append("worker killed: the server did not reclaim its mappings or fds")


def main() -> int:
    """Run the three scenarios and report."""
    torch.set_num_threads(1)
    resource_tracker.ensure_running()  # a process-lifetime fd: start it before the baselines
    problems: list[str] = []
    run_normal(problems)
    run_server_killed(problems)
    run_worker_killed(problems)
    for p in problems:
        print("  PROBLEM:", p)
    print("RESULT:", "OK" if not problems else f"FAILED ({len(problems)} problems)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
