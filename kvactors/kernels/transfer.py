"""The torch kernel of one planned transfer: the callable the GatherActor hands its stream.

The actors know kernels only through this module. A plain backend (no staging): a reused
plan runs its specialised kernel (bound now on a sender's thread, where the launch runs too;
else bound in the launch, which reports a failed bind as the copy's failure), anything else
the general fast kernel. A device backend (``scratch`` given: the stream's staging buffers
and index cache, with the backend's copy policy): a plan of a cache entry runs the entry's
staged binding (:mod:`kvactors.kernels._bound`, decided on its first run), anything else the
general staged path.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from kvactors.kernels._bound import staged_binding
from kvactors.kernels.fast import ScratchCache, reused_kernel, run_fast

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvactors.core.plan_cache import KernelMemo
    from kvactors.core.plans import TransferPlan

__all__ = ("ScratchCache", "torch_kernel")


def torch_kernel(
    plan: TransferPlan,
    paged: Any,
    objects: Sequence[torch.Tensor],
    *,
    memo: KernelMemo | None,
    inference: bool,
    must_block: Callable[[torch.Tensor, torch.Tensor], bool] | None,
    scratch: ScratchCache | None,
    bind_now: bool,
) -> Callable[[], None]:
    """The kernel of ``plan`` over the operands (see the module docstring); ``must_block``:
    the device backend's copy policy (with ``scratch``)."""
    # The pinned host tensors the staged path uploads new block ids from: the kernel is the
    # transfer's lease, kept until the stream ran it, so they outlive their copies (rule 3).
    keep: list[torch.Tensor] = []
    if scratch is not None:
        policy = _never if must_block is None else must_block

        def copy(dst: torch.Tensor, src: torch.Tensor) -> None:  # the unbound path's
            dst.copy_(src, non_blocking=not policy(dst, src))

        def staged() -> None:
            # Inference tensors (made under torch.inference_mode) are written only in it.
            with torch.inference_mode(inference):
                binding: Any = False if memo is None else memo.staged
                if binding is None:
                    binding = _bind(memo, plan, paged, objects)
                if binding:
                    binding.run(plan, paged, objects, policy, scratch, keep)
                else:  # the plan cache made the plan for these very operands: no check
                    run_fast(
                        plan, paged, objects, copy=copy, scratch=scratch, checked=True, keep=keep
                    )

        return staged

    if memo is not None and bind_now:
        # reused_kernel's warm path in line (the entry's binder decided): no frame of its own.
        ids = plan.request.block_ids
        last, binder = memo.last, memo.binder
        try:
            if last is not None and last[0] == ids:
                bound = last[1]
            elif binder is not None:
                bound = binder(plan)
                memo.last = (ids, bound)
            else:
                bound = reused_kernel(plan, paged, objects, memo, inference=inference)
        except Exception:  # bound again in the launch, which reports the failure
            pass
        else:
            return functools.partial(bound, paged, objects)

    def kernel() -> None:
        if memo is not None:
            reused_kernel(plan, paged, objects, memo, inference=inference)(paged, objects)
            return
        with torch.inference_mode(inference):
            run_fast(plan, paged, objects, checked=True)

    return kernel


def _bind(memo: Any, plan: TransferPlan, paged: Any, objects: Sequence[torch.Tensor]) -> Any:
    # The entry's first run decides (concurrent first runs decide alike; the last one stays).
    try:
        binding: Any = staged_binding(plan, paged, objects) or False
    except Exception:  # the unbound path serves it, and raises what it raises
        binding = False
    memo.staged = binding
    return binding


def _never(_dst: torch.Tensor, _src: torch.Tensor) -> bool:
    return False
