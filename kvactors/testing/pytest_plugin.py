"""pytest fixtures for the kvactors fakes.

Register with ``pytest_plugins = ["kvactors.testing.pytest_plugin"]`` in a conftest.

Fixtures:
    fake_mlu: a :class:`~kvactors.testing.FakeVendor` installed as ``torch.mlu`` /
        ``torch_mlu`` for the test (default knobs; parametrize knobs through
        ``fake_vendor`` directly when needed).
    fake_musa: the same for ``torch.musa`` / ``torch_musa``.

Helper:
    require_torch_devices(kind): skip the calling test unless a fake of ``kind`` gets real
        ``torch.device`` objects in this process (one vendor per process; choose it with
        ``KVACTORS_FAKE_VENDOR=mlu|musa``, as ``scripts/test.sh`` does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvactors.testing._install import fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.testing.vendor import FakeVendor

__all__ = ("fake_mlu", "fake_musa", "require_torch_devices")


def require_torch_devices(kind: str) -> None:
    """Skip the running test unless fakes of ``kind`` have real torch devices here.

    Call it inside the test (not at collection): the first fake installed in a process
    claims the device name, so the answer can change while tests run.
    """
    from kvactors.testing._device import ENV_VENDOR, process_vendor

    owner = process_vendor()
    if owner is not None and owner != kind:
        pytest.skip(
            f"this process's torch device name belongs to the fake {owner}; vendor code "
            f"that builds torch.device({kind!r}) runs under {ENV_VENDOR}={kind} "
            "(scripts/test.sh)"
        )


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
