"""The serving validation's tap (kvactors_serving.tap) on LMCache's own CPU op.

The engine test runs the tap inside vLLM; here it runs on format 12 blocks (vLLM CPU
attention's [NB, NH, BS, 2*HS] per layer) in-process, so its own rules are checked fast: a
restore that brings back other bytes is named, a store that writes other bytes than LMCache's
op is named, the wrapper keeps the annotation LMCache reads. How the tap gets into the
processes ``vllm serve`` makes: the harness registers :func:`kvactors_serving.tap.hook` as a
vLLM general plugin, which wraps the kvactors CPU ops class there (never the op itself).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]

ROOT = Path(__file__).resolve().parents[2]

NB, NH, BS, HS2, NL, CHUNK = 12, 2, 4, 16, 2, 8  # 2 blocks per chunk


def _setup():
    from lmcache import lmcache_native as native
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer as lmcache_op

    sd = native.PageBufferShapeDesc()
    for f, v in {
        "kv_size": 1,
        "nl": NL,
        "nb": NB,
        "bs": BS,
        "nh": NH,
        "hs": HS2,
        "element_size": 4,
        "block_stride_elems": 0,
    }.items():
        setattr(sd, f, v)
    sd.dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    paged = [torch.randn(NB, NH, BS, HS2, generator=gen) for _ in range(NL)]
    return native, lmcache_op, sd, paged


def _call(fn, native, sd, paged, objs, ids, d2h, skip=0):
    direction = native.TransferDirection.D2H if d2h else native.TransferDirection.H2D
    fmt = native.EngineKVFormat(12)
    fn(paged, objs, ids, torch.device("cpu"), direction, sd, CHUNK, fmt, skip)


def _chunks(n):
    return [torch.empty(NL, CHUNK, NH * HS2) for _ in range(n)]


def test_a_faithful_round_trip_compares_every_restored_block() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()
    tap = KVTap(op=op, reference_op=op)
    tapped = tap.wrap()
    objs = _chunks(2)
    _call(tapped, native, sd, paged, objs, [0, 1, 2, 3], d2h=True)
    _call(tapped, native, sd, paged, objs, [6, 7, 8, 9], d2h=False, skip=1)
    assert tap.chunks_stored == 2
    assert tap.chunks_compared == 2
    assert tap.layer_blocks_compared == 3 * NL  # one block skipped
    assert tap.mismatches == []
    assert tap.chunks_unknown == 0
    assert torch.equal(paged[1][7], paged[1][1])


def test_a_broken_restore_is_named_by_chunk_and_block() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()
    tap = KVTap(op=op, reference_op=op, corrupt_restore=True)
    tapped = tap.wrap()
    objs = _chunks(2)
    _call(tapped, native, sd, paged, objs, [0, 1, 2, 3], d2h=True)
    before = paged[0][6].clone()
    _call(tapped, native, sd, paged, objs, [6, 7, 8, 9], d2h=False)
    assert not torch.equal(paged[0][6], before)  # flipped in the paged KV the engine reads
    (m,) = tap.mismatches
    assert (m.block, m.layer, m.differing_bytes) == (6, 0, 1)
    assert m.stored_as.startswith("store call 0, chunk 0 (blocks [0, 1]")
    assert tap.corrupted == [f"chunk {m.chunk} block 6 layer 0 byte 0"]


def test_a_store_that_differs_from_lmcaches_op_is_named() -> None:
    from kvactors_serving.tap import KVTap

    native, op, sd, paged = _setup()

    def off_by_one_block(paged_, objs, ids, *rest):  # a layout bug the same both ways
        op(paged_, objs, [(i + 1) % NB for i in ids], *rest)

    tap = KVTap(op=off_by_one_block, reference_op=op)
    _call(tap.wrap(), native, sd, paged, _chunks(2), [0, 1, 2, 3], d2h=True)
    assert tap.differential_chunks == 2
    assert tap.differential_mismatches == ["store call 0, chunk 0", "store call 0, chunk 1"]


def test_the_wrapper_keeps_the_annotation_lmcache_reads() -> None:
    from lmcache.v1.multiprocess.transfer_context.base import (
        _detect_block_transfer_accepts_tensor,
    )

    from kvactors_lmcache.ops import KvactorsCpuOps
    from kvactors_serving.tap import KVTap

    op = KvactorsCpuOps().multi_layer_block_kv_transfer
    assert _detect_block_transfer_accepts_tensor(op)
    wrapped = KVTap(op=op, reference_op=op).wrap()
    assert _detect_block_transfer_accepts_tensor(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(op)


# ---- how the tap gets into a ``vllm serve`` process: the harness's vLLM plugin -----------------


@pytest.fixture
def hooked_class(monkeypatch: pytest.MonkeyPatch):
    """``KvactorsCpuOps`` with its ``__init__`` put back after the test (the hook wraps it)."""
    from kvactors_lmcache.ops import KvactorsCpuOps

    monkeypatch.setattr(KvactorsCpuOps, "__init__", KvactorsCpuOps.__init__)
    return KvactorsCpuOps


def test_the_harness_registers_the_hook_as_a_vllm_plugin() -> None:
    """vLLM calls every ``vllm.general_plugins`` entry point in each process it makes; with the
    harness's folder on the path (first on every engine's PYTHONPATH) the tap's hook is one."""
    from importlib.metadata import entry_points

    from kvactors_serving.procedure import HARNESS_PATH, engine_env
    from kvactors_serving.tap import hook

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("kvac")]
    assert ep.load() is hook
    assert engine_env("kvactors")["PYTHONPATH"].split(os.pathsep)[0] == HARNESS_PATH


def test_a_process_started_as_the_harness_starts_engines_taps_its_ops(tmp_path: Path) -> None:
    """A fresh interpreter with the engine environment, loading the plugins as vLLM does: the
    plugin loads neither LMCache nor numba, and the ops made afterwards are tapped and report
    into the directory."""
    from kvactors_serving.procedure import engine_env
    from kvactors_serving.tap import TAP_ENV, read_reports

    script = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        "for ep in entry_points(group='vllm.general_plugins'):\n"
        "    ep.load()()\n"
        "loaded = {'lmcache', 'numba', 'kvactors_lmcache'} & set(sys.modules)\n"
        "assert not loaded, loaded  # vLLM's CPU platform scans the modules after the plugins\n"
        "import torch\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.adapters.test_serving_tap import _call, _chunks, _setup\n"
        "from kvactors_lmcache.ops import KvactorsCpuOps\n"
        "native, _, sd, paged = _setup()\n"
        "_call(KvactorsCpuOps().multi_layer_block_kv_transfer, native, sd, paged, _chunks(2),\n"
        "      [0, 1, 2, 3], d2h=True)\n"
    )
    env = engine_env("kvactors") | {TAP_ENV: str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(ROOT)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = read_reports(tmp_path)
    assert report["chunks_stored"] == 2
    assert report["differential_chunks"] == 2
    assert report["differential_mismatches"] == []
    assert report["pid"] != os.getpid()


def test_the_hook_taps_the_cpu_ops_and_compares_across_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hooked_class
) -> None:
    """Two ops instances stand for two processes (they share nothing but the directory): the
    second restores what the first stored, and its tap compares against the first's blocks;
    a restore that brings back other bytes is named."""
    from kvactors_serving.tap import TAP_ENV, hook, read_reports

    monkeypatch.setenv(TAP_ENV, str(tmp_path))
    hook()
    hook()  # vLLM may load the plugins twice in one process: wrapped once
    native, _, sd, paged = _setup()  # format 12 blocks, as vLLM's CPU attention has them
    a, b = hooked_class(), hooked_class()
    assert a._kvactors_tap is not b._kvactors_tap
    assert a._kvactors_tap.op.__func__ is hooked_class.multi_layer_block_kv_transfer
    objs = _chunks(2)
    assert read_reports(tmp_path) == []  # reports come from the ops that moved KV
    _call(a.multi_layer_block_kv_transfer, native, sd, paged, objs, [0, 1, 2, 3], d2h=True)
    _call(b.multi_layer_block_kv_transfer, native, sd, paged, objs, [6, 7, 8, 9], d2h=False)
    reports = read_reports(tmp_path)
    assert len(reports) == 2
    stored, restored = sorted(reports, key=lambda r: r["restores"])
    assert stored["chunks_stored"] == 2
    assert stored["differential_chunks"] == 2
    assert stored["differential_mismatches"] == []
    assert restored["chunks_compared"] == 2
    assert restored["chunks_unknown"] == 0
    assert restored["layer_blocks_compared"] > 0
    assert restored["mismatches"] == []
    objs[1][0, 0, 0] += 1.0  # a chunk LMCache never stored: unknown, not compared
    _call(b.multi_layer_block_kv_transfer, native, sd, paged, objs, [6, 7, 8, 9], d2h=False)
    restored = next(r for r in read_reports(tmp_path) if r["restores"] == 2)
    assert restored["chunks_unknown"] == 1
    assert restored["chunks_compared"] == 3


def test_without_the_variable_the_hook_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, hooked_class
) -> None:
    from kvactors_serving.tap import TAP_ENV, hook

    monkeypatch.delenv(TAP_ENV, raising=False)
    made = hooked_class.__init__
    hook()
    assert hooked_class.__init__ is made
    ops = hooked_class()
    assert "multi_layer_block_kv_transfer" not in vars(ops)
