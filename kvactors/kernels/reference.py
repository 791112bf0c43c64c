"""The reference kernel: obviously correct per-block, per-layer, per-plane loops (test oracle).

Theory of operation. This file shares no view-building code with the fast path on purpose: it
spells out, format by format, which ``[BS, NH, HS]`` slice of the paged memory one block of one
layer and plane is (contract 3.2), and copies it to or from the object rows
``[t0, t0 + BS)`` with one ``copy_`` per (block, layer, plane). It is slow by design and only
runs on validated plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvactors.core.layouts import Direction, KVFormat
from kvactors.core.plans import paged_units
from kvactors.errors import TransferValidationError

if TYPE_CHECKING:
    import torch

    from kvactors.core.plans import TransferPlan

__all__ = ("run_reference",)


def _block(
    fmt: KVFormat, units: list[torch.Tensor], nl: int, layer: int, p: int, b: int
) -> torch.Tensor:
    """The ``[BS, NH, HS]`` view of block ``b`` of ``layer``, plane ``p``."""
    if fmt is KVFormat.NB_NL_TWO_BS_NH_HS:
        return units[0][b, layer, p]
    if fmt is KVFormat.NB_NL_TWO_NH_BS_HS:
        return units[0][b, layer, p].transpose(0, 1)  # [NH, BS, HS] -> [BS, NH, HS]
    if fmt is KVFormat.NL_X_TWO_NB_BS_NH_HS:
        return units[layer][p, b]
    if fmt is KVFormat.NL_X_NB_TWO_BS_NH_HS:
        return units[layer][b, p]
    if fmt is KVFormat.NL_X_NB_BS_HS:
        return units[layer][b].unsqueeze(1)
    if fmt is KVFormat.NL_X_TWO_NB_NH_BS_HS:
        return units[layer][p, b].transpose(0, 1)
    if fmt is KVFormat.NL_X_NB_TWO_NH_BS_HS:
        return units[layer][b, p].transpose(0, 1)
    if fmt in (KVFormat.TWO_X_NL_X_NB_BS_NH_HS, KVFormat.NL_X_TWO_X_NB_BS_NH_HS):
        return units[p * nl + layer][b]  # units are [K_0.., V_0..] for both
    if fmt in (KVFormat.NL_X_NB_NH_BS_TWO_HS, KVFormat.NL_X_NB_NH_BS_CS):
        return units[layer][b].transpose(0, 1)  # [NH, BS, 2*HS] -> [BS, NH, 2*HS]
    if fmt in (KVFormat.NL_X_NB_BS_NH_TWO_HS, KVFormat.NL_X_NB_BS_NH_CS, KVFormat.NL_X_NB_BS_NH_HS):
        return units[layer][b]
    raise AssertionError(f"no reference mapping for {fmt!r}")


def run_reference(plan: TransferPlan, paged: object, objects: list[torch.Tensor]) -> None:
    """Run a validated plan with plain loops (the oracle the fast path is tested against).

    Args:
        plan: A plan from :func:`kvactors.core.plans.plan_transfer`.
        paged: The same paged operand the plan was made for.
        objects: The same host chunks the plan was made for.

    Raises:
        TransferValidationError: The operands are not the ones the plan was made for.
    """
    units = paged_units(plan.spec, paged)
    if (
        tuple(t.data_ptr() for t in units) != plan.paged_ptrs
        or tuple(o.data_ptr() for o in objects) != plan.object_ptrs
    ):
        raise TransferValidationError("operands differ from the planned ones", field="plan")
    shape = plan.request.shape
    nl, bs, nh, hs = shape.nl, shape.bs, shape.nh, shape.hs
    tokens = plan.request.chunk_size
    ids = plan.request.block_ids
    for seg in plan.segments:
        obj = objects[seg.obj]
        for j in range(seg.start, seg.stop):
            b = ids[j]
            t0 = seg.row0 + (j - seg.start) * bs
            for layer in range(nl):
                for p in range(plan.spec.planes):
                    blk = _block(plan.fmt, units, nl, layer, p, b)
                    if plan.spec.planes == 1:  # MLA (nh == 1) and fused K/V: [NL, T, NH*HS]
                        one = obj.reshape(nl, tokens, nh * hs)
                        rows = one[layer, t0 : t0 + bs].view(bs, nh, hs)
                    else:
                        rows = obj[p, layer, t0 : t0 + bs].view(bs, nh, hs)
                    if plan.direction is Direction.D2H:
                        rows.copy_(blk)
                    else:
                        blk.copy_(rows)
