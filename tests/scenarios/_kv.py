"""Small paged-KV geometry shared by the scenario tests (one layout, one dtype, tiny sizes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvactors.core.layouts import Direction, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.kernels.reference import run_reference

NL, NB, BS, NH, HS = 2, 16, 4, 2, 8
BPC = 2  # blocks per chunk
CHUNK = BPC * BS
FMT = KVFormat.NL_X_TWO_NB_BS_NH_HS
DTYPE = torch.bfloat16


def shape(**overrides: Any) -> ShapeDesc:
    """The shape descriptor of :func:`paged` (fields overridable)."""
    fields: dict[str, Any] = {
        "kv_size": 2,
        "nl": NL,
        "nb": NB,
        "bs": BS,
        "nh": NH,
        "hs": HS,
        "element_size": 2,
        "dtype": "bfloat16",
    }
    fields.update(overrides)
    return ShapeDesc(**fields)


def request(
    direction: Direction | int, ids: list[int] | tuple[int, ...], **overrides: Any
) -> TransferRequest:
    """A transfer request over :func:`paged` (request fields overridable)."""
    fields: dict[str, Any] = {
        "fmt": int(FMT),
        "direction": int(direction),
        "block_ids": tuple(ids),
        "chunk_size": CHUNK,
        "shape": shape(),
    }
    fields.update(overrides)
    return TransferRequest(**fields)


def paged(seed: int) -> list[torch.Tensor]:
    """Per-layer ``[2, NB, BS, NH, HS]`` views of one seeded allocation."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(NL, 2, NB, BS, NH, HS, generator=g).to(DTYPE)
    return list(base.unbind(0))


def objects(n: int, fill: float = -1.0) -> list[torch.Tensor]:
    """``n`` host chunks filled with a sentinel."""
    return [torch.full((2, NL, CHUNK, NH * HS), fill, dtype=DTYPE) for _ in range(n)]


def expected_gather(
    src: list[torch.Tensor], ids: list[int] | tuple[int, ...]
) -> list[torch.Tensor]:
    """What a D2H gather of ``ids`` from ``src`` must produce (reference kernel oracle)."""
    n = -(-len(ids) // BPC)
    out = objects(n)
    req = request(Direction.D2H, ids)
    run_reference(plan_transfer(req, src, out, device_type="cpu"), src, out)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw 16-bit pattern (bit-exact comparisons, NaN-proof)."""
    return t.contiguous().view(torch.int16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality."""
    return torch.equal(bits(a), bits(b))


@dataclasses.dataclass
class Snapshot:
    """Clones of a set of tensors, to prove a rejected call changed none of them."""

    tensors: list[torch.Tensor]
    copies: list[torch.Tensor]

    @classmethod
    def of(cls, *groups: Any) -> Snapshot:
        flat: list[torch.Tensor] = []

        def walk(x: Any) -> None:
            if isinstance(x, torch.Tensor):
                if x.device.type == "cpu":
                    flat.append(x)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)

        for g in groups:
            walk(g)
        return cls(flat, [t.clone() for t in flat])

    def unchanged(self) -> bool:
        return all(same(t, c) for t, c in zip(self.tensors, self.copies, strict=True))
