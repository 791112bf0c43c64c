"""The demo's simulated serving workload: requests, chunk keys and their KV content.

Theory of operation. A request is a sequence of chunks; a chunk's key chains the key of the
chunk before it (as LMCache's prefix hashes do), so two requests share cached chunks exactly
when they share a prefix. Requests draw their prefix from a few shared "documents" (system
prompts, few-shot headers) and end with chunks of their own. The KV content of a chunk is a
pure function of its key, so any copy anywhere can be checked bit for bit against a freshly
generated expectation without keeping the original around: that is how the demo verifies
every restored block independently of the path that produced it.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

import msgspec
import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ("Geometry", "Request", "chunk_content", "chunk_key", "make_requests")


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """The simulated model's paged KV cache (NHD, one tensor per layer)."""

    num_layers: int = 8
    num_blocks: int = 512
    block_size: int = 16
    num_heads: int = 4
    head_size: int = 64
    chunk_blocks: int = 4
    dtype: str = "bfloat16"

    @property
    def chunk_tokens(self) -> int:
        """Token slots per chunk."""
        return self.chunk_blocks * self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype."""
        dt = getattr(torch, self.dtype)
        assert isinstance(dt, torch.dtype)
        return dt

    @property
    def pool_shape(self) -> tuple[int, ...]:
        """``[NL, 2, NB, BS, NH, HS]``: every layer's paged tensor, stacked."""
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_heads,
            self.head_size,
        )

    @property
    def object_shape(self) -> tuple[int, ...]:
        """One host chunk, token-major: ``[2, NL, T, NH*HS]``."""
        return (2, self.num_layers, self.chunk_tokens, self.num_heads * self.head_size)


class Request(msgspec.Struct, kw_only=True):
    """One simulated request: its chunk keys and, while admitted, its blocks."""

    rid: int
    keys: list[int]
    blocks: list[int] = msgspec.field(default_factory=list)


def chunk_key(parent: int, part: str) -> int:
    """The key of the chunk after ``parent`` whose own tokens are named ``part``."""
    h = hashlib.blake2b(f"{parent}:{part}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def chunk_content(key: int, geo: Geometry) -> torch.Tensor:
    """The KV of chunk ``key`` in paged block order: ``[NL, 2, CB, BS, NH, HS]``.

    A cheap integer hash of (key, element index) reinterpreted as the KV dtype, so every
    element of every chunk differs with high probability (NaN patterns included: compare bits).
    """
    shape = (geo.num_layers, 2, geo.chunk_blocks, geo.block_size, geo.num_heads, geo.head_size)
    n = 1
    for d in shape:
        n *= d
    mul, add = (key & 0xFFFF) | 1, (key >> 16) & 0x7FFFFFFF
    x = torch.arange(n, dtype=torch.int64).mul_(mul).add_(add)
    x.bitwise_xor_(x >> 7)
    itemsize = torch.empty(0, dtype=geo.torch_dtype).element_size()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    return x.to(bits).view(geo.torch_dtype).reshape(shape)


def chunk_object(content: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """The host chunk (``[2, NL, T, NH*HS]``) holding ``content`` (paged block order)."""
    return content.transpose(0, 1).reshape(geo.object_shape)


def make_requests(
    n: int, *, seed: int, prefixes: int = 6, max_chunks: int = 6
) -> Iterator[Request]:
    """``n`` requests sharing prefixes of ``prefixes`` documents, ``max_chunks`` chunks each."""
    rng = random.Random(seed)
    for rid in range(n):
        doc = rng.randrange(prefixes)
        shared = rng.randint(0, max_chunks - 1)
        own = rng.randint(1, max_chunks - shared)
        keys: list[int] = []
        parent = doc + 1
        for i in range(shared):
            parent = chunk_key(parent, f"doc{doc}/{i}")
            keys.append(parent)
        for i in range(own):
            parent = chunk_key(parent, f"req{rid}/{i}")
            keys.append(parent)
        yield Request(rid=rid, keys=keys)
