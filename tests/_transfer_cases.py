"""Deterministic paged-KV / host-chunk builders shared by the transfer engine tests."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat, PagedKind, ShapeDesc
from kvactors.core.plans import TransferRequest

ALLOCS = ("stacked", "gapped", "separate", "shuffled", "permuted", "permuted_separate", "padded")
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtypes() -> list[torch.dtype]:
    out = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.float8_e4m3fn)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


@dataclasses.dataclass
class Case:
    """Parameters of one transfer case; :meth:`build` makes identical operands every time."""

    fmt: KVFormat
    nl: int
    nb: int
    bs: int
    nh: int
    hs: int
    dtype: torch.dtype
    alloc: str
    seed: int
    n_objects: int = 2
    bpo: int = 2
    mla_4d: bool = False
    declare_stride: bool = False
    split_width: bool = False

    @property
    def spec(self) -> Any:
        return FORMAT_SPECS[self.fmt]

    def shape(self, *, dtype_name: bool = True) -> ShapeDesc:
        spec = self.spec
        bse = 0
        if self.declare_stride and self.alloc == "padded" and spec.allows_block_padding:
            bse = self._block_stride()
        return ShapeDesc(
            kv_size=spec.planes,
            nl=self.nl,
            nb=self.nb,
            bs=self.bs,
            nh=self.nh,
            hs=self.hs,
            element_size=torch.empty(0, dtype=self.dtype).element_size(),
            block_stride_elems=bse,
            dtype=str(self.dtype).removeprefix("torch.") if dtype_name else None,
        )

    def request(self, direction: int, block_ids: list[int], skip: int = 0) -> TransferRequest:
        return TransferRequest(
            fmt=int(self.fmt),
            direction=direction,
            block_ids=tuple(block_ids),
            chunk_size=self.bpo * self.bs,
            skip_blocks=skip,
            shape=self.shape(),
        )

    def _unit_shape(self) -> tuple[int, ...]:
        return self.spec.tensor_shape(self.nl, self.nb, self.bs, self.nh, self.hs)

    def _block_stride(self) -> int:
        inner = 1
        for n in self._unit_shape()[1:]:
            inner *= n
        return inner + 3

    def _n_units(self) -> int:
        kind = self.spec.kind
        if kind is PagedKind.CROSS_LAYER:
            return 1
        return self.nl if kind is PagedKind.LAYER_LIST else 2 * self.nl

    def build(self) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        """``(paged, objects, backing)``: backing = every buffer the views live in."""
        g = torch.Generator().manual_seed(self.seed)
        rng = random.Random(self.seed)
        shape = self._unit_shape()
        numel = 1
        for n in shape:
            numel *= n
        n_units = self._n_units()
        backing: list[torch.Tensor] = []

        def fresh(n: int) -> torch.Tensor:
            t = torch.empty(n, dtype=self.dtype)
            raw(t).random_(generator=g)
            backing.append(t)
            return t

        units: list[torch.Tensor] = []
        alloc = self.alloc
        if alloc == "padded" and not self.spec.allows_block_padding:
            alloc = "gapped"
        if alloc == "stacked":
            buf = fresh(numel * n_units)
            units = [buf[u * numel : (u + 1) * numel].view(shape) for u in range(n_units)]
        elif alloc == "gapped":
            gap = 5
            buf = fresh((numel + gap) * n_units + gap)
            units = [
                buf[gap + u * (numel + gap) : gap + u * (numel + gap) + numel].view(shape)
                for u in range(n_units)
            ]
        elif alloc == "separate":
            units = [fresh(numel).view(shape) for _ in range(n_units)]
        elif alloc == "shuffled":
            buf = fresh(numel * n_units)
            order = list(range(n_units))
            rng.shuffle(order)
            units = [buf[o * numel : (o + 1) * numel].view(shape) for o in order]
        elif alloc in ("permuted", "permuted_separate"):
            # Each tensor is a permuted view of a differently ordered allocation.
            perm = list(range(len(shape)))
            rng.shuffle(perm)
            phys = [shape[i] for i in perm]
            inv = [perm.index(i) for i in range(len(shape))]
            if alloc == "permuted":
                buf = fresh(numel * n_units)
                parts = [buf[u * numel : (u + 1) * numel] for u in range(n_units)]
            else:
                parts = [fresh(numel) for _ in range(n_units)]
            units = [part.view(phys).permute(inv) for part in parts]
        elif alloc == "padded":
            # Block axis first (the formats that allow padding), the rest tight, each block
            # followed by 3 unused elements.
            inner = [1]
            for n in reversed(shape[1:]):
                inner.insert(0, inner[0] * n)
            bstride = inner[0] + 3
            per = bstride * self.nb
            buf = fresh(per * n_units + 7)
            units = [
                buf.as_strided(shape, (bstride, *inner[1:]), 7 + u * per) for u in range(n_units)
            ]
        else:
            raise AssertionError(alloc)
        if self.split_width and self.spec.single_plane and self.hs % 2 == 0:
            # The same memory with the packed width as [2, HS/2] (K, V): LMCache's other form.
            # (as_strided keeps every stride, a size-1 block axis's included: a view may not)
            half = self.hs // 2
            units = [
                t.as_strided(
                    (*t.shape[:-1], 2, half),
                    (*t.stride()[:-1], half * t.stride(-1), t.stride(-1)),
                    t.storage_offset(),
                )
                for t in units
            ]
        paged: Any
        kind = self.spec.kind
        if kind is PagedKind.CROSS_LAYER:
            paged = units[0]
        elif kind is PagedKind.KV_LIST:
            paged = [units[: self.nl], units[self.nl :]] if self.seed % 2 else list(units)
        elif kind is PagedKind.KV_PAIRS:
            pairs = zip(units[: self.nl], units[self.nl :], strict=True)
            paged = [tuple(kv) if self.seed % 2 else list(kv) for kv in pairs]
        else:
            paged = units
        tokens = self.bpo * self.bs
        oshape = self.spec.object_shape(self.nl, tokens, self.nh, self.hs)
        if self.spec.planes == 1 and self.mla_4d:
            oshape = (1, *oshape)
        objects = []
        for _ in range(self.n_objects):
            o = torch.empty(oshape, dtype=self.dtype)
            raw(o).random_(generator=g)
            objects.append(o)
        return paged, objects, backing


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [raw(t).clone() for t in tensors]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b, strict=True))


def block_view(fmt: KVFormat, paged: Any, nl: int, layer: int, p: int, b: int) -> torch.Tensor:
    """Test-side ``[BS, NH, HS]`` view of one block (independent of kvactors' kernels)."""
    if fmt is KVFormat.TWO_X_NL_X_NB_BS_NH_HS:
        flat = (
            list(paged[0]) + list(paged[1])
            if len(paged) == 2 and isinstance(paged[0], list)
            else list(paged)
        )
        return flat[p * nl + layer][b]
    if fmt is KVFormat.NL_X_TWO_X_NB_BS_NH_HS:
        return paged[layer][p][b]
    if fmt is KVFormat.NB_NL_TWO_BS_NH_HS:
        return paged[b, layer, p]
    if fmt is KVFormat.NB_NL_TWO_NH_BS_HS:
        return paged[b, layer, p].transpose(0, 1)
    t = paged[layer]
    if FORMAT_SPECS[fmt].single_plane and t.dim() == 5:
        t = t.flatten(-2)  # the [2, HS/2] form of the packed width (a view here)
    return {
        KVFormat.NL_X_TWO_NB_BS_NH_HS: lambda: t[p, b],
        KVFormat.NL_X_NB_TWO_BS_NH_HS: lambda: t[b, p],
        KVFormat.NL_X_NB_BS_HS: lambda: t[b].unsqueeze(1),
        KVFormat.NL_X_TWO_NB_NH_BS_HS: lambda: t[p, b].transpose(0, 1),
        KVFormat.NL_X_NB_TWO_NH_BS_HS: lambda: t[b, p].transpose(0, 1),
        KVFormat.NL_X_NB_NH_BS_TWO_HS: lambda: t[b].transpose(0, 1),
        KVFormat.NL_X_NB_BS_NH_TWO_HS: lambda: t[b],
        KVFormat.NL_X_NB_NH_BS_CS: lambda: t[b].transpose(0, 1),
        KVFormat.NL_X_NB_BS_NH_CS: lambda: t[b],
        KVFormat.NL_X_NB_BS_NH_HS: lambda: t[b],
    }[fmt]()
