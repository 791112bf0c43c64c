"""A bounded load against a served engine: prompts with shared prefixes, a fixed number in flight.

:func:`load_prompts` makes one round's prompts (fresh prefixes of several whole-chunk lengths,
each shared by several requests with their own suffixes); :func:`run_load` sends them with at
most ``in_flight`` requests open and returns every answer (or the error) in prompt order, with
the round's wall time. :func:`summary` gives the figures a comparison reports: failures, p50 and
p99 time to first token, requests per second.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvactors_serving.api_server import Answer, ApiServer

__all__ = ("LoadResult", "load_prompts", "run_load", "summary")


@dataclass(frozen=True)
class LoadResult:
    """One round: the answers (None where the request failed), the errors, the wall time."""

    answers: list[Answer | None]
    errors: list[str]
    wall_s: float


def load_prompts(
    *,
    seed: int,
    vocab: int,
    chunk: int,
    prefixes: tuple[int, ...] = (1, 2, 4, 6),
    per_prefix: int = 4,
) -> list[list[int]]:
    """``len(prefixes) * per_prefix`` prompts: every prefix (``prefixes`` in chunks) shared by
    ``per_prefix`` prompts with their own suffixes (1 to ``chunk // 2`` tokens), interleaved."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    heads = [fresh(n * chunk) for n in prefixes]
    out = []
    for i in range(per_prefix):
        for head in heads:
            out.append(head + fresh(1 + (i * 7 + len(head)) % (chunk // 2)))
    return out


def run_load(
    server: ApiServer, prompts: list[list[int]], *, in_flight: int, max_tokens: int
) -> LoadResult:
    """Send ``prompts`` with at most ``in_flight`` open at once."""

    def one(tokens: list[int]) -> Answer | str:
        try:
            return server.complete(tokens, max_tokens=max_tokens)
        except Exception as exc:  # a failed request is a result of the load, reported
            return f"{type(exc).__name__}: {exc}"[:500]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    answers = [None if isinstance(r, str) else r for r in results]
    return LoadResult(answers, [r for r in results if isinstance(r, str)], wall)


def _quantile(xs: list[float], q: float) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def summary(rounds: list[LoadResult]) -> dict[str, float]:
    """Requests, failures, p50/p99 TTFT (s), requests/s and hit tokens over ``rounds``."""
    answers = [a for r in rounds for a in r.answers if a is not None]
    ttft = sorted(a.ttft_s for a in answers)
    n = sum(len(r.answers) for r in rounds)
    return {
        "requests": float(n),
        "failed": float(sum(len(r.errors) for r in rounds)),
        "ttft_p50_s": _quantile(ttft, 0.50) if ttft else float("nan"),
        "ttft_p99_s": _quantile(ttft, 0.99) if ttft else float("nan"),
        "req_per_s": n / sum(r.wall_s for r in rounds),
        "hit_tokens": float(sum(a.hit for a in answers)),
    }
