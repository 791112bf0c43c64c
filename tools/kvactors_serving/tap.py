"""A tap on the worker's resolved ``multi_layer_block_kv_transfer``: KV bit equality across
store and restore, the store differential against LMCache's own op, timing, a fault knob.

Theory of operation. LMCache's engine-driven context resolves the device ops once per process
(``lmcache.v1.platform.resolve_device_ops``) and calls the op's bound method. :func:`install`
replaces that method on the resolved instance with a wrapper made by ``functools.wraps``, so
LMCache still reads the ``lmcache_objects_ptrs`` annotation and keeps the tensor calling
convention. The wrapper calls the op (or, for an A/B measurement, LMCache's own CPU op on the
same arguments), then:

* after a store (D2H), keeps a copy of every stored paged block, keyed by the bytes of the
  host chunk the op wrote, and runs LMCache's own op on the same blocks into fresh buffers to
  check the chunk bytes are identical (the differential: a round trip alone hides a layout bug
  that is the same both ways);
* after a restore (H2D), finds the stored blocks by the bytes of the chunk being restored and
  compares every restored (non-skipped) block with them bit for bit.

CPU copies are complete when the op returns, so the checks read the blocks right after the
call. The fault knob ``corrupt_restore`` flips one byte of the first restored block in the
paged KV itself (the engine then reads it), before the comparison, as a broken restore would.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.util
import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = (
    "TAP_ENV",
    "KVTap",
    "Mismatch",
    "hook",
    "install",
    "install_from_env",
    "read_reports",
)

TAP_ENV = "KVACTORS_SERVING_TAP"
"""A directory: every kvactors CPU ops instance made in a process of ``vllm serve`` is tapped
(:func:`hook`); the stored blocks and the reports are kept there."""

_numbers = itertools.count()


@dataclass
class Mismatch:
    """One restored chunk whose blocks differ from the stored ones."""

    chunk: str  # the chunk's key (sha256 prefix of its host bytes)
    stored_as: str  # "store call S, chunk C (tokens A-B)"
    restore_call: int
    layer: int
    block: int  # the restored block id
    differing_bytes: int


@dataclass
class _Stored:
    blocks: list[list[torch.Tensor]]  # [block][layer] copies of the paged block
    where: str


@dataclass
class KVTap:
    """State of the tap; all counters are of this process."""

    op: Any
    reference_op: Any
    corrupt_restore: bool = False
    check: bool = True
    use_reference: bool = False  # serve transfers with LMCache's own op (A/B timing)
    stores: int = 0
    restores: int = 0
    chunks_stored: int = 0
    chunks_restored: int = 0
    chunks_compared: int = 0
    layer_blocks_compared: int = 0
    bytes_compared: int = 0
    chunks_unknown: int = 0  # restored chunks whose bytes were never stored here
    differential_chunks: int = 0
    differential_mismatches: list[str] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"store": 0.0, "retrieve": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"store": 0, "retrieve": 0})
    directory: Path | None = None  # shared blocks and the report file (KVACTORS_SERVING_TAP)
    _stored: dict[str, _Stored] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _report_path: Path | None = None

    def wrap(self) -> Any:
        """The wrapper that replaces the op (keeps its signature and annotations)."""
        op = self.op

        @functools.wraps(op)
        def tapped(
            paged: Any,
            objects: Any,
            block_ids: Any,
            device: Any,
            direction: Any,
            shape_desc: Any,
            chunk_size: int,
            fmt: Any,
            skip_blocks: int,
            **keywords: Any,  # layerwise (LMCache's next releases): passed through
        ) -> None:
            serve = self.reference_op if self.use_reference else op
            store = direction.name == "D2H"  # LMCache's TransferDirection (H2D 0, D2H 1)
            t0 = time.perf_counter()
            serve(
                paged,
                objects,
                block_ids,
                device,
                direction,
                shape_desc,
                chunk_size,
                fmt,
                skip_blocks,
                **keywords,
            )
            dt = time.perf_counter() - t0
            kind = "store" if store else "retrieve"
            with self._lock:
                self.seconds[kind] += dt
                self.calls[kind] += 1
                if self.check:
                    ids = [int(b) for b in block_ids]
                    args = (paged, objects, ids, device, direction, shape_desc, chunk_size, fmt)
                    if store:
                        self._after_store(*args)
                    else:
                        self._after_restore(*args, int(skip_blocks))
                if self.directory is not None:
                    self._write_report()

        return tapped

    # -- store ------------------------------------------------------------------------------

    def _after_store(
        self,
        paged: Any,
        objects: Any,
        ids: list[int],
        device: Any,
        direction: Any,
        shape_desc: Any,
        chunk_size: int,
        fmt: Any,
    ) -> None:
        call = self.stores
        self.stores += 1
        layers = _layers(paged)
        per = len(ids) // len(objects)
        bs = int(shape_desc.bs)
        if not self.use_reference and self.reference_op is not self.op:
            fresh = [torch.empty_like(o) for o in objects]
            self.reference_op(
                paged, fresh, list(ids), device, direction, shape_desc, chunk_size, fmt, 0
            )
            for i, (mine, theirs) in enumerate(zip(objects, fresh, strict=True)):
                self.differential_chunks += 1
                if not torch.equal(_bytes(mine), _bytes(theirs)):
                    self.differential_mismatches.append(f"store call {call}, chunk {i}")
        for i, obj in enumerate(objects):
            blocks = ids[i * per : (i + 1) * per]
            key = _key(obj)
            where = f"store call {call}, chunk {i} (blocks {blocks}, {per * bs} tokens)"
            kept = _Stored([[_block(t, b).clone() for t in layers] for b in blocks], where)
            self._stored[key] = kept
            if self.directory is not None:
                self._save(key, kept)
            self.chunks_stored += 1

    def _save(self, key: str, kept: _Stored) -> None:
        assert self.directory is not None
        folder = self.directory / "blocks"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        torch.save({"blocks": kept.blocks, "where": f"pid {os.getpid()} {kept.where}"}, tmp)
        tmp.replace(folder / f"{key}.pt")

    def _load(self, key: str) -> _Stored | None:
        if self.directory is None:
            return None
        path = self.directory / "blocks" / f"{key}.pt"
        if not path.exists():
            return None
        data = torch.load(path, weights_only=True)
        return _Stored(data["blocks"], str(data["where"]))

    def _write_report(self) -> None:
        assert self.directory is not None
        if self._report_path is None:
            self._report_path = self.directory / f"tap-{os.getpid()}-{next(_numbers)}.json"
        tmp = self._report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report()))
        tmp.replace(self._report_path)

    # -- restore ----------------------------------------------------------------------------

    def _after_restore(
        self,
        paged: Any,
        objects: Any,
        ids: list[int],
        device: Any,
        direction: Any,
        shape_desc: Any,
        chunk_size: int,
        fmt: Any,
        skip: int,
    ) -> None:
        call = self.restores
        self.restores += 1
        layers = _layers(paged)
        per = len(ids) // len(objects)
        for i, obj in enumerate(objects):
            self.chunks_restored += 1
            key = _key(obj)
            stored = self._stored.get(key) or self._load(key)
            blocks = ids[i * per : (i + 1) * per]
            first = max(0, skip - i * per)  # blocks skipped in this chunk
            if self.corrupt_restore and not self.corrupted and first < len(blocks):
                raw = _block(layers[0], blocks[first]).reshape(-1).view(torch.uint8)
                raw[0] ^= 0xFF  # in the paged KV the engine reads next
                self.corrupted.append(f"chunk {key} block {blocks[first]} layer 0 byte 0")
            if stored is None:
                self.chunks_unknown += 1
                continue
            self.chunks_compared += 1
            for j in range(first, len(blocks)):
                for layer, t in enumerate(layers):
                    got = _block(t, blocks[j])
                    want = stored.blocks[j][layer]
                    self.layer_blocks_compared += 1
                    self.bytes_compared += got.numel() * got.element_size()
                    diff = int((_bytes(got) != _bytes(want)).sum())
                    if diff:
                        self.mismatches.append(
                            Mismatch(key, stored.where, call, layer, blocks[j], diff)
                        )

    def report(self) -> dict[str, Any]:
        """The tap's counters as plain JSON values."""
        return {
            "stores": self.stores,
            "restores": self.restores,
            "chunks_stored": self.chunks_stored,
            "chunks_restored": self.chunks_restored,
            "chunks_compared": self.chunks_compared,
            "chunks_unknown": self.chunks_unknown,
            "layer_blocks_compared": self.layer_blocks_compared,
            "bytes_compared": self.bytes_compared,
            "mismatches": [m.__dict__ for m in self.mismatches],
            "differential_chunks": self.differential_chunks,
            "differential_mismatches": list(self.differential_mismatches),
            "corrupted": list(self.corrupted),
            "op_seconds": dict(self.seconds),
            "op_calls": dict(self.calls),
            "pid": os.getpid(),
        }


def _layers(paged: Any) -> list[torch.Tensor]:
    if isinstance(paged, torch.Tensor):
        return [paged]
    out: list[torch.Tensor] = []
    for p in paged:
        out.extend(_layers(p))
    return out


def _block(layer: torch.Tensor, block: int) -> torch.Tensor:
    # vLLM's CPU attention (formats 10-13): every layer is [NB, ...], blocks first.
    return layer[block]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _key(obj: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(obj).numpy().tobytes()).hexdigest()[:16]


def install(*, corrupt_restore: bool = False) -> KVTap:
    """Tap the CPU ops LMCache resolved in this process; returns the tap.

    ``reference_op`` is LMCache's own CPU op (``CpuDeviceOps``, what LMCache resolves on CPU
    without a plugin). When ``KVACTORS_SERVING_TAP`` already tapped them, that tap is returned;
    else the new tap shares its blocks through that directory when the variable names one.
    """
    from lmcache.v1.platform import resolve_device_ops

    ops = resolve_device_ops("cpu")
    existing = getattr(ops, "_kvactors_tap", None)
    if isinstance(existing, KVTap):
        existing.corrupt_restore = corrupt_restore
        return existing
    # Not tapped by the plugin (:func:`hook`; in the offline engine the ops LMCache resolves
    # can predate it): the tap keeps its blocks where KVACTORS_SERVING_TAP says, as there.
    where = os.environ.get(TAP_ENV, "").strip()
    directory = Path(where) if where else None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    return _install_on(ops, corrupt_restore=corrupt_restore, directory=directory)


def hook() -> None:
    """vLLM's general plugin (entry point ``vllm.general_plugins``): taps the kvactors CPU ops
    of a ``vllm serve`` process when ``KVACTORS_SERVING_TAP`` names a directory.

    The harness is not installed, so ``tools/kvactors_serving-0.dist-info`` registers the entry
    point for a process that has ``tools/`` on its path (:func:`procedure.engine_env` puts it
    there). vLLM calls the plugin in every process it makes (API server, engine core, workers)
    before the KV connector exists; from then on every ``KvactorsCpuOps`` LMCache makes in the
    process is tapped (:func:`install_from_env`). Without the variable nothing changes.

    The plugin imports nothing: importing the ops loads LMCache and numba, and a worker calls
    the plugins just before vLLM's CPU platform scans the loaded modules (the scan fails on
    llvmlite's library object). So the class is wrapped once its module has run; at once if it
    already has. vLLM may call the plugin more than once in one process; the class is wrapped
    once.
    """
    if not os.environ.get(TAP_ENV, "").strip():
        return
    module = sys.modules.get(_OPS_MODULE)
    if module is not None:
        _wrap_ops_class(module)
    elif not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


_OPS_MODULE = "kvactors_lmcache.ops"


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``kvactors_lmcache.ops`` as the other finders do, and wraps its CPU ops class
    after the module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _OPS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_and_wrap(module: Any) -> None:
            run(module)
            _wrap_ops_class(module)

        spec.loader.exec_module = run_and_wrap  # type: ignore[method-assign]
        return spec


def _wrap_ops_class(module: Any) -> None:
    cls = module.KvactorsCpuOps
    made = cls.__init__
    if getattr(made, "_kvactors_tap_hook", False):
        return

    @functools.wraps(made)
    def tapped_init(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        install_from_env(self)

    tapped_init._kvactors_tap_hook = True  # type: ignore[attr-defined]
    cls.__init__ = tapped_init


def install_from_env(ops: Any) -> KVTap | None:
    """Tap ``ops`` (a CPU ops instance LMCache just made) when ``KVACTORS_SERVING_TAP`` names a
    directory; None otherwise."""
    where = os.environ.get(TAP_ENV, "").strip()
    if not where:
        return None
    directory = Path(where)
    directory.mkdir(parents=True, exist_ok=True)
    return _install_on(ops, corrupt_restore=False, directory=directory)


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """Every tap report written under ``directory`` (one per tapped ops instance)."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob("tap-*.json"))]


def _install_on(ops: Any, *, corrupt_restore: bool, directory: Path | None) -> KVTap:
    from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps

    op = ops.multi_layer_block_kv_transfer
    if type(ops) is CpuDeviceOps:
        reference = op
    else:
        own = CpuDeviceOps()
        own.ensure_native()  # as LMCache's CPU spec does (DeviceSpec.get_ops)
        reference = own.multi_layer_block_kv_transfer
    tap = KVTap(op=op, reference_op=reference, corrupt_restore=corrupt_restore, directory=directory)
    ops.multi_layer_block_kv_transfer = tap.wrap()
    ops._kvactors_tap = tap  # the report is written from the first call on
    return tap
