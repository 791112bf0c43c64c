"""A warm staged call on an accelerator makes no view of its own: the paged view is kept
while the call passes the same first paged tensor (and never keeps that tensor's memory
alive), the staging buffers' views live with the buffers, and a whole contiguous chunk is
copied as itself. What a warm call runs is seen through a ``TorchFunctionMode`` on the
calling thread (the plain call runs there), on both fakes."""

from __future__ import annotations

import collections
import gc
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvactors.cli.bench.vendor import pool
from kvactors.core.layouts import Direction
from kvactors.core.plans import plan_transfer
from kvactors.devices.mlu import MluBackend
from kvactors.kernels.reference import run_reference
from kvactors.runtime import Runtime
from kvactors.testing import fake_vendor
from tests.scenarios._kv import BPC, objects, paged, request, same

CASES = [
    ("mlu", "nhd"),
    ("mlu", "hnd"),
    ("mlu", "mla"),
    ("mlu", "nhd_separate"),
    ("musa", "nhd"),
    ("musa", "mla"),
    ("musa", "nhd_separate"),
]
VIEWS = {"view", "as_strided", "reshape", "permute", "__getitem__", "select", "narrow", "unbind"}
MOVES = {"index_select", "copy_", "index_copy_"}


class _Seen(TorchFunctionMode):
    """The names of the torch functions called on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.names[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def _backend(kind: str) -> Any:
    return MluBackend(layout_source="resolved") if kind == "mlu" else kind


def _renewed(paged: Any) -> Any:
    """``paged`` with its first tensor a new tensor object over the same memory (the same
    metadata: the plan cache's key matches)."""
    if isinstance(paged, torch.Tensor):
        return paged.view(paged.shape)
    return type(paged)([_renewed(paged[0]), *paged[1:]])


@pytest.mark.parametrize(("kind", "layout"), CASES)
@pytest.mark.parametrize("direction", [1, 0])
def test_a_warm_call_makes_no_view(kind: str, layout: str, direction: int) -> None:
    with fake_vendor(kind) as fake, Runtime(_backend(kind), default_timeout=60.0) as rt:
        p = pool(fake, layout)
        handle = rt.backend.current_stream_handle(0)
        chunks = len(p.objects)

        def call(paged: Any, start: int) -> collections.Counter[str]:
            seen = _Seen()
            with seen:
                rt.transfer(
                    p.request(direction, tuple(range(start, start + 2 * chunks * 4, 2))),
                    paged,
                    p.objects,
                    stream_handle=handle,
                    complete=False,
                )
            fake.synchronize()
            return seen.names

        for start in range(3):  # warm: the plan, its binding, the buffers, the views
            call(p.paged, start)
        warm = call(p.paged, 1)
        assert not VIEWS & set(warm), warm
        moved = {k: v for k, v in warm.items() if k in MOVES}
        # A kernel per chunk; with layers apart one per layer (and plane, gathering).
        kernels = 1
        if layout == "nhd_separate":
            kernels = len(p.paged) * (2 if direction == 1 else 1)
        if direction == 1:
            assert moved == {"index_select": kernels * chunks, "copy_": chunks}, warm
        else:
            assert moved == {"copy_": chunks, "index_copy_": kernels * chunks}, warm
        # The same memory behind another first tensor: its paged view is made anew (and the
        # counting sees views where they are made).
        assert VIEWS & set(call(_renewed(p.paged), 2))


@pytest.mark.parametrize("kind", ["mlu", "musa"])
@pytest.mark.parametrize("layout", ["nhd", "nhd_separate"])
@pytest.mark.parametrize("direction", [1, 0])
def test_the_kept_paged_views_do_not_keep_the_pool_alive(
    kind: str, layout: str, direction: int
) -> None:
    with fake_vendor(kind) as fake, Runtime(_backend(kind), default_timeout=60.0) as rt:
        mod = getattr(torch, kind)
        p = pool(fake, layout)
        nbytes = sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in ([p.paged] if isinstance(p.paged, torch.Tensor) else list(p.paged))
            }.values()
        )
        handle = rt.backend.current_stream_handle(0)
        for start in range(3):
            rt.transfer(
                p.request(direction, tuple(range(start, start + 16, 2))),
                p.paged,
                p.objects,
                stream_handle=handle,
            )
        fake.synchronize()
        held = mod.memory_allocated()
        del p
        gc.collect()
        assert held - mod.memory_allocated() >= nbytes
        assert rt.statistics().transfers_failed == 0


@pytest.mark.parametrize("kind", ["mlu", "musa"])
@pytest.mark.parametrize("skip", [0, 1])
def test_layers_apart_move_the_reference_bytes_cold_and_warm(kind: str, skip: int) -> None:
    # Layers in allocations of their own, chunks the call fills in part (``skip_blocks``):
    # every call, the first (binding) and the later ones (kept views), against the
    # reference kernel on host copies; slots outside the segments keep their sentinel.
    with fake_vendor(kind) as fake, Runtime(_backend(kind), default_timeout=60.0) as rt:
        host = [t.clone() for t in paged(5)]
        layers = [fake.adopt(t.clone()) for t in host]
        for ids in [(3, 7, 9), (4, 8, 10), (3, 7, 9)]:
            chunks = -(-(len(ids) + skip) // BPC)
            req = request(Direction.D2H, ids, skip_blocks=skip)
            got, want = objects(chunks), objects(chunks)
            rt.transfer(req, layers, got)
            run_reference(plan_transfer(req, host, want, device_type="cpu"), host, want)
            assert all(same(a, b) for a, b in zip(got, want, strict=True))
            src = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in got]
            req = request(Direction.H2D, ids, skip_blocks=skip)
            rt.transfer(req, layers, src)
            run_reference(plan_transfer(req, host, src, device_type="cpu"), host, src)
            fake.synchronize()
            assert all(same(t.cpu(), h) for t, h in zip(layers, host, strict=True))
