"""The torch kernel of one planned transfer: the callable the GatherActor hands its stream.

The actors know kernels only through this module: a reused plan of a plain backend runs its
specialised kernel (bound now on a sender's thread, where the launch runs too; else bound in
the launch, which reports a failed bind as the copy's failure), anything else the general
fast kernel with the backend's copy policy and the stream's staging buffers.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

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
    copy: Callable[[torch.Tensor, torch.Tensor], None] | None,
    scratch: ScratchCache | None,
    bind_now: bool,
) -> Callable[[], None]:
    """The kernel of ``plan`` over the operands (see the module docstring)."""
    if memo is not None and bind_now:
        try:
            bound = reused_kernel(plan, paged, objects, memo, inference=inference)
        except Exception:  # bound again in the launch, which reports the failure
            pass
        else:
            return functools.partial(bound, paged, objects)

    # The pinned host tensors the staged path uploads new block ids from: the kernel is the
    # transfer's lease, kept until the stream ran it, so they outlive their copies (rule 3).
    keep: list[torch.Tensor] = []

    def kernel() -> None:
        if memo is not None:
            reused_kernel(plan, paged, objects, memo, inference=inference)(paged, objects)
            return
        # Inference tensors (made under torch.inference_mode) are written only in it. The
        # plan was made for these very operands (the plan cache matched them): no pointer
        # check.
        with torch.inference_mode(inference):
            run_fast(plan, paged, objects, copy=copy, scratch=scratch, checked=True, keep=keep)

    return kernel
