"""pytest fixtures for the kvactors fakes.

Register with ``pytest_plugins = ["kvactors.testing.pytest_plugin"]`` in a conftest.

Fixtures:
    fake_mlu: a :class:`~kvactors.testing.FakeVendor` installed as ``torch.mlu`` /
        ``torch_mlu`` for the test (default knobs; parametrize knobs through
        ``fake_vendor`` directly when needed).
    fake_musa: the same for ``torch.musa`` / ``torch_musa``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvactors.testing import fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.testing.vendor import FakeVendor

__all__ = ("fake_mlu", "fake_musa")


@pytest.fixture
def fake_mlu() -> Iterator[FakeVendor]:
    """A fake ``torch_mlu`` installed for one test."""
    with fake_vendor("mlu") as fake:
        yield fake


@pytest.fixture
def fake_musa() -> Iterator[FakeVendor]:
    """A fake ``torch_musa`` installed for one test."""
    with fake_vendor("musa") as fake:
        yield fake
