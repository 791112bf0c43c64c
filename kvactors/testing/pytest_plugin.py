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

Option:
    ``--kvactors-fake-vendor=mlu|musa``: install that fake (default knobs) for the whole
        session, before collection, so a suite written for a real card (which checks
        ``torch.musa`` at import) runs on it unmodified. Load the plugin with
        ``-p kvactors.testing.pytest_plugin`` in a suite that does not register it::

            KVACTORS_FAKE_VENDOR=musa python -m pytest -p kvactors.testing.pytest_plugin \
                --kvactors-fake-vendor=musa tests/v1/platform/devices/musa
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pytest

from kvactors.testing._install import fake_vendor

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.testing.vendor import FakeVendor

__all__ = (
    "ENV_SESSION",
    "fake_mlu",
    "fake_musa",
    "install_for_process",
    "pytest_addoption",
    "pytest_configure",
    "pytest_unconfigure",
    "require_torch_devices",
)

_SESSION_FAKE = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kvactors-fake-vendor``: a fake vendor installed for the whole session."""
    parser.getgroup("kvactors").addoption(
        "--kvactors-fake-vendor",
        choices=("mlu", "musa"),
        default=None,
        help="install kvactors' fake torch_mlu / torch_musa for the whole session, before "
        "collection (one vendor per process; set KVACTORS_FAKE_VENDOR to the same kind)",
    )


ENV_SESSION = "KVACTORS_FAKE_SESSION"
_SITECUSTOMIZE = f"""\
import os

if os.environ.get({ENV_SESSION!r}):
    from kvactors.testing.pytest_plugin import install_for_process

    install_for_process(os.environ[{ENV_SESSION!r}])
"""


def install_for_process(kind: str) -> None:
    """Install a fake of ``kind`` for the rest of this process (knob ``cross_process``).

    What a session's spawned children run at start-up (``sitecustomize``), so that a handle
    the session exports opens in them as it would in a second process on a card.
    """
    import atexit

    stack = contextlib.ExitStack()
    stack.enter_context(fake_vendor(kind, cross_process=True))
    atexit.register(stack.close)


def pytest_configure(config: pytest.Config) -> None:
    """Install the session's fake vendor, if the option asks for one, and make every Python
    child the session starts (``multiprocessing`` spawn included) install it too."""
    kind = config.getoption("--kvactors-fake-vendor", default=None)
    if kind:
        import os
        import tempfile

        stack = contextlib.ExitStack()
        stack.enter_context(fake_vendor(str(kind), cross_process=True))
        site = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvactors-fake-site-"))
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
        previous = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_SESSION)}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, previous["PYTHONPATH"]) if p)
        os.environ[ENV_SESSION] = str(kind)
        stack.callback(_restore_environ, previous)
        config.stash[_SESSION_FAKE] = stack


def _restore_environ(previous: dict[str, str | None]) -> None:
    import os

    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's fake vendor (its streams drained, its threads joined)."""
    stack = config.stash.get(_SESSION_FAKE, None)
    if stack is not None:
        del config.stash[_SESSION_FAKE]
        stack.close()


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
