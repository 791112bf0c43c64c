"""A warm host call makes no view of the pool: the one-call host kernels (the stacked and rows
gathers, the per-layer gather, the rows and block-plane scatters) keep their views of the
paged tensors while calls pass those very tensors, and never keep the pool's memory alive.
Each torch call is one release of the GIL, which several callers then wait for in turn:
fewer calls per transfer is what lets callers side by side go faster than one. Seen through
a ``TorchFunctionMode`` on the calling thread (CPU calls run there); every call checked
against the reference kernel's bytes."""

from __future__ import annotations

import collections
import gc
import weakref
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvactors.cli.bench._pools import Pool
from kvactors.core.plans import plan_transfer
from kvactors.kernels.reference import run_reference
from kvactors.runtime import Runtime

LAYOUTS = ["nhd", "hnd", "mla", "kv_list", "nhd_separate"]
VIEWS = {"view", "as_strided", "numpy", "permute", "unbind", "__getitem__", "narrow"}


class _OnPool(TorchFunctionMode):
    """The names of the torch functions called on ``tensor`` (its first argument)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if args and args[0] is self.tensor:
            self.names[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def _first(paged: Any) -> torch.Tensor:
    return paged if isinstance(paged, torch.Tensor) else _first(paged[0])


def _renewed(paged: Any) -> Any:
    """``paged`` with its first tensor a new tensor object over the same memory."""
    if isinstance(paged, torch.Tensor):
        return paged.view(paged.shape)
    return type(paged)([_renewed(paged[0]), *paged[1:]])


class _Buffer(bytearray):
    """Host memory whose end is observable (a weak reference to it dies with the pool)."""


def _clone(paged: Any) -> Any:
    if isinstance(paged, torch.Tensor):
        return paged.clone()
    return [_clone(t) for t in paged]


def _tensors(paged: Any) -> list[torch.Tensor]:
    if isinstance(paged, torch.Tensor):
        return [paged]
    return [t for x in paged for t in _tensors(x)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", [1, 0])
def test_a_warm_host_call_makes_no_view_of_the_pool(layout: str, direction: int) -> None:
    p = Pool("small", layout, 32, 1)
    g = torch.Generator().manual_seed(7)
    for t in [*_tensors(p.paged), *p.objects]:
        t.copy_(torch.randn(t.shape, generator=g))
    with Runtime("cpu", default_timeout=60.0) as rt:

        def call(paged: Any, ids: list[int]) -> collections.Counter[str]:
            seen = _OnPool(_first(paged))
            with seen:
                rt.transfer(p.request(direction, ids), paged, p.objects)
            return seen.names

        def moves_the_reference_bytes(paged: Any, ids: list[int]) -> collections.Counter[str]:
            ref_paged, ref_objs = _clone(p.paged), _clone(p.objects)
            req = p.request(direction, ids)
            run_reference(
                plan_transfer(req, ref_paged, ref_objs, device_type="cpu"), ref_paged, ref_objs
            )
            names = call(paged, ids)
            for a, b in zip(
                _tensors([p.paged, p.objects]), _tensors([ref_paged, ref_objs]), strict=True
            ):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
            return names

        cold = moves_the_reference_bytes(p.paged, p.id_sets[0])
        assert VIEWS & set(cold), cold  # the counting sees the views where they are made
        call(p.paged, p.id_sets[1])
        warm = moves_the_reference_bytes(p.paged, p.id_sets[2])
        assert not VIEWS & set(warm), warm
        # The same memory behind another first tensor: its view is made anew.
        assert VIEWS & set(moves_the_reference_bytes(_renewed(p.paged), p.id_sets[3]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", [1, 0])
def test_the_kept_host_views_do_not_keep_the_pool_alive(layout: str, direction: int) -> None:
    buffers: list[weakref.ref[_Buffer]] = []

    def alloc(shape: tuple[int, ...]) -> torch.Tensor:
        buf = _Buffer(2 * torch.Size(shape).numel())
        buffers.append(weakref.ref(buf))
        return torch.frombuffer(buf, dtype=torch.bfloat16).view(shape)

    with Runtime("cpu", default_timeout=60.0) as rt:
        p = Pool("small", layout, 32, 1, zeros=alloc)
        assert buffers
        for ids in p.id_sets[:3]:
            rt.transfer(p.request(direction, ids), p.paged, p.objects)
        del p
        gc.collect()
        assert all(r() is None for r in buffers)  # freed with the runtime and its cache alive
        assert rt.statistics().transfers_failed == 0
