"""The operands of the bench's cases: one layout's paged KV and host chunks."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ("FORMATS", "MODELS", "Pool", "pin_host")

FORMATS = {
    "nhd": KVFormat.NL_X_TWO_NB_BS_NH_HS,
    "hnd": KVFormat.NL_X_TWO_NB_NH_BS_HS,
    "mla": KVFormat.NL_X_NB_BS_HS,
    "kv_list": KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
    "nhd_separate": KVFormat.NL_X_TWO_NB_BS_NH_HS,
}
"""NHD (format 1), HND (6), MLA (3), K/V lists (9), and NHD with every layer allocated apart."""
MODELS = {"small": (8, 4, 64), "8b": (32, 8, 128)}
"""``(layers, KV heads, head size)``; MLA has one head of ``head * 4.5``."""
BS, TOKENS = 16, 256  # tokens per block and per chunk


class Pool:
    """``layout``'s paged KV of ``model`` (bf16, ``nb`` blocks, filled) as the engine passes
    it (``paged``), its stacked tensor (``stack``, blocks on ``block_dim``; None when every
    layer is allocated apart), ``chunks`` host chunks of ``tokens`` tokens (pinned: ``pin``)
    and sets of block ids for one chunk each (``id_sets``)."""

    def __init__(
        self,
        model: str,
        layout: str,
        nb: int,
        chunks: int,
        *,
        zeros: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
        tokens: int = TOKENS,
        pin: bool = False,
        seed: int = 0,
    ) -> None:
        nl, nh, hs = MODELS[model]
        self.fmt, self.spec = FORMATS[layout], FORMAT_SPECS[FORMATS[layout]]
        spec, alloc = self.spec, zeros or (lambda s: torch.zeros(s, dtype=torch.bfloat16))
        if spec.is_mla:
            nh, hs = 1, hs * 9 // 2
        unit = spec.tensor_shape(nl, nb, BS, nh, hs)
        self.stack: torch.Tensor | None = None
        self.paged: Any
        if layout == "nhd_separate":
            self.paged = [alloc(unit).fill_(1) for _ in range(nl)]
        elif spec.is_kv_list:
            self.stack = alloc((2, nl, *unit)).fill_(1)  # [P, L, B, S, H, D]
            self.paged, self.block_dim = [list(p.unbind(0)) for p in self.stack], 2
        else:
            self.stack = alloc((nl, *unit)).fill_(1)
            self.paged, self.block_dim = list(self.stack.unbind(0)), 1 + spec.axes.index("B")
        oshape = spec.object_shape(nl, tokens, nh, hs)
        objects = [torch.ones(oshape, dtype=torch.bfloat16) for _ in range(chunks)]
        self.objects = [pin_host(o) for o in objects] if pin else objects
        rng, self.bpo, self.tokens = random.Random(seed), tokens // BS, tokens
        # Set ``i`` lies in quarter ``i % 4`` of the blocks (when a quarter holds a chunk):
        # the sets ``[c::4]`` of four callers are apart, as concurrent requests' blocks are.
        q = nb // 4 if nb // 4 >= self.bpo else nb
        self.id_sets = [
            rng.sample(range(q * (i % 4) % nb, q * (i % 4) % nb + q), self.bpo) for i in range(256)
        ]
        self.dims = (nl, nh, hs)
        self.shape = ShapeDesc(
            kv_size=spec.planes, nl=nl, nb=nb, bs=BS, nh=nh, hs=hs, element_size=2, dtype="bfloat16"
        )

    def chunk_view(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` (one host chunk's shape) seen in :attr:`stack`'s axis order, so that one
        ``index_select`` of the stack on :attr:`block_dim` fills it."""
        (nl, h, d), j, sp = self.dims, self.bpo, self.spec
        if sp.is_mla:
            return chunk.view(nl, j, BS, d)
        if sp.is_kv_list:
            return chunk.view(2, nl, j, BS, h, d)
        v = chunk.view(2, nl, j, BS, h, d)
        return v.permute(1, 0, 2, 4, 3, 5) if sp.is_hnd else v.permute(1, 0, 2, 3, 4, 5)

    def request(self, direction: int, ids: Sequence[int]) -> TransferRequest:
        """The request moving ``ids`` (one chunk per :attr:`bpo` of them) in ``direction``."""
        fmt, shape = int(self.fmt), self.shape
        return TransferRequest(
            fmt=fmt, direction=direction, block_ids=tuple(ids), chunk_size=self.tokens, shape=shape
        )


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` page-locked where torch can pin (an accelerator or a fake vendor is present), else
    ``t`` itself: CPU-only torch raises on every pin call."""
    try:
        return t.pin_memory()
    except RuntimeError:
        return t
