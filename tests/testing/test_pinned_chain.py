"""Pinned host memory through nested fakes, on every torch of the matrix.

Each installed fake answers ``Tensor.is_pinned`` for the memory it pinned and passes anything
else down the chain; torch itself is asked only when no fake has named the private backend
(from torch 2.5 on, torch would ask that backend's hooks, which Python cannot register there).
"""

from __future__ import annotations

import pytest
import torch

from kvactors.testing import fake_vendor


@pytest.mark.parametrize("outer", ["mlu", "musa"])
def test_each_fake_answers_for_its_pinned_memory(outer: str) -> None:
    inner = "musa" if outer == "mlu" else "mlu"
    with fake_vendor(outer) as first, fake_vendor(inner) as second:
        by_first, by_second, plain = torch.zeros(8), torch.zeros(8), torch.zeros(8)
        first.memory.add_pinned(by_first)
        second.memory.add_pinned(by_second)
        assert by_first.is_pinned()  # reached through the later fake's patch
        assert by_second.is_pinned()
        assert not plain.is_pinned()
        assert torch.zeros(4).pin_memory().is_pinned()
        assert torch.empty(4, pin_memory=True).is_pinned()


def test_plain_memory_after_a_fake_was_removed() -> None:
    with fake_vendor("mlu") as fake:
        pinned = torch.zeros(8).pin_memory()
        assert pinned.is_pinned()
        assert fake.memory.is_pinned(pinned)
    # The private name stays taken (irreversible); a fake of the other kind still answers.
    with fake_vendor("musa"):
        assert not torch.zeros(8).is_pinned()
