"""Rule 3 (own until done) on the path users run: ``Runtime.transfer(..., complete=False)`` on
the fake MLU and MUSA.

The caller drops its operands once the call returned; a gate on the default stream keeps the
device from reaching the copies while the test looks. The runtime must still hold the operands
then (weak references alive) and let them go once the device completed (a kernel that forgets
its operands once enqueued fails the first check).
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.core.layouts import Direction
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios._kv import objects, paged, request

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvactors.devices.base import Backend
    from kvactors.testing import FakeVendor

_WAIT = 10.0  # bounds a wait only a hang would exhaust; never decides a result
IDS = (3, 5)


def _backend(kind: str) -> Backend | str:
    if kind == "mlu":
        from kvactors.devices.mlu.backend import MluBackend

        # The engine resolved NHD explicitly (the legacy vLLM-MLU answer is ambiguous).
        return MluBackend(layout_source="resolved")
    return kind


def _blocks(fake: FakeVendor, layers: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([fake.peek(t)[:, list(IDS)] for t in layers])


@pytest.mark.parametrize("clear", [False, True], ids=["dropped", "lists-cleared"])
@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_rule3_enqueued_scatter_owns_its_operands_until_the_device_ran(
    kind: str, clear: bool
) -> None:
    """The caller drops its operands, or (``lists-cleared``) empties the very lists it passed:
    the runtime holds the tensors themselves, snapshotted at submission, not the lists."""
    with fake_vendor(kind, seed=5) as fake:
        layers = [fake.adopt(t) for t in paged(2)]
        with Runtime(_backend(kind)) as rt:
            gate = threading.Event()
            fake.default_stream(0).worker.submit(lambda: gate.wait(_WAIT))
            try:
                chunk = objects(1, 5.0)[0].pin_memory()
                ops = [chunk]
                done = rt.transfer(request(Direction.H2D, IDS), layers, ops, complete=False)
                assert done.blocks == len(IDS)
                before = _blocks(fake, layers)
                assert not torch.equal(before, torch.full_like(before, 5.0)), (
                    "the copy ran before the gate opened: the check below proves nothing"
                )
                chunk_ref = weakref.ref(chunk)
                layer_refs = [weakref.ref(t) for t in layers]
                if clear:
                    ops.clear()
                    layers.clear()
                del chunk, ops, layers  # the caller keeps nothing
                gc.collect()
                assert chunk_ref() is not None, (
                    "the host chunk was released while the device still had its copy queued"
                )
                assert all(r() is not None for r in layer_refs), (
                    "a paged layer was released while the device still had its copy queued"
                )
            finally:
                gate.set()  # never leave the stream blocked, even when a check failed
            rt.synchronize()  # answered once every lease before it was dropped
            gc.collect()
            assert chunk_ref() is None, "the runtime kept the host chunk after the copy completed"
            after = [r() for r in layer_refs]
            assert all(t is None for t in after), "the runtime kept a paged layer after the copy"
            assert rt.statistics().transfers_ok == 1


@pytest.mark.parametrize("kind", ["mlu", "musa"])
def test_complete_false_returns_before_the_device_ran(kind: str) -> None:
    """On an accelerator a ``complete=False`` call returns once its copies are enqueued (the
    lane's lease owns the operands), even when the caller's thread launched them."""
    with fake_vendor(kind, seed=5) as fake:
        layers = [fake.adopt(t) for t in paged(2)]
        with Runtime(_backend(kind)) as rt:
            gate = threading.Event()
            fake.default_stream(0).worker.submit(lambda: gate.wait(_WAIT))
            try:
                chunk = objects(1, 5.0)[0].pin_memory()
                rt.transfer(request(Direction.H2D, IDS), layers, [chunk], complete=False)
                before = _blocks(fake, layers)
                assert not gate.is_set()
                assert not torch.equal(before, torch.full_like(before, 5.0)), (
                    "the call waited for the device"
                )
            finally:
                gate.set()
            rt.synchronize()
            after = _blocks(fake, layers)
            assert torch.equal(after, torch.full_like(after, 5.0))
