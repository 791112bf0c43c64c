"""The prompts of the serving validation: store prompts and warm prompts with designed hits.

Token ids only (the model has no tokenizer). With LMCache chunks of 64 tokens and vLLM blocks
of 32, every warm prompt's expected hit is the same for LMCache (whole chunks) and for vLLM's
native prefix caching (whole blocks, never the last prompt token): chunk-aligned (256),
not aligned (a 261-token shared prefix hits 256; an 84-token one hits 64) and zero. Every
prompt plus its generated tokens stays inside its last partial chunk, so no run stores a chunk
that would change a later run's hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvactors.errors import InvalidSettingError

__all__ = ("CHUNK", "BLOCK", "Prompt", "Workload", "make_workload")

CHUNK = 64
BLOCK = 32


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids, with the hit length it is designed to get (``None``: any)."""

    label: str
    tokens: tuple[int, ...]
    expected_hit: int | None = None

    def as_json(self) -> dict[str, object]:
        """The prompt as the engine process reads it."""
        return {"label": self.label, "tokens": list(self.tokens)}


@dataclass(frozen=True)
class Workload:
    """Store prompts (4 whole chunks each), the warm prompts that hit them, and the batch of
    the preemption run: short prompts (3 blocks each, a 4th after 2 generated tokens) that
    hit 64 tokens, so that a KV cache of a dozen blocks runs out while they decode."""

    store: tuple[Prompt, ...]
    warm: tuple[Prompt, ...]
    preempt: tuple[Prompt, ...]


def make_workload(*, seed: int = 0, vocab: int = 1024, max_tokens: int = 24) -> Workload:
    """The store and warm prompts for ``seed`` (deterministic).

    Raises:
        InvalidSettingError: ``max_tokens`` would let a prompt's generated tokens complete a chunk.
    """
    if not 1 <= max_tokens <= 30:
        raise InvalidSettingError(
            f"max_tokens must be 1..30 (the prompts leave 30 tokens), got {max_tokens}",
            setting="max_tokens",
        )
    rng = random.Random(seed)

    def fresh(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    prefix = 4 * CHUNK
    s = [fresh(prefix + 30) for _ in range(3)]
    store = tuple(Prompt(f"store-{i}", t) for i, t in enumerate(s))
    # Each warm prompt ends at least 30 tokens before its next chunk boundary.
    warm = (
        Prompt("hit256-a", s[0][:prefix] + fresh(2), 256),
        Prompt("hit256-b", s[1][:prefix] + fresh(2), 256),
        Prompt("hit256-c", s[2][:prefix] + fresh(2), 256),
        Prompt("hit256-of-261", s[0][: prefix + 5] + fresh(2), 256),
        Prompt("hit64", s[1][:CHUNK] + fresh(30), 64),
        Prompt("hit64-of-84", s[2][:84] + fresh(10), 64),
        Prompt("miss", fresh(30), 0),
    )
    preempt = tuple(
        Prompt(f"short-{i}", s[i % 3][:n] + fresh(94 - n), 64)
        for i, n in enumerate((64, 84, 64, 84, 64, 84))
    )
    return Workload(store=store, warm=warm, preempt=preempt)
