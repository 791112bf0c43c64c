"""Suite-wide settings: one intra-op thread (stable, no OpenMP stalls on 2 cores)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

torch.set_num_threads(1)

pytest_plugins = (
    ["kvactors.testing.pytest_plugin"]
    if importlib.util.find_spec("kvactors.testing.pytest_plugin") is not None
    else []
)


@pytest.fixture(params=["python", "compiled"])
def hotpath_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test twice: on the Python twins (``KVACTORS_HOTPATH=0``) and on the compiled
    hot path (skipped where it is not built, unless ``KVACTORS_HOTPATH=1`` asks for it: then
    a missing build fails)."""
    from kvactors import hotpath

    if request.param == "python":
        monkeypatch.setenv("KVACTORS_HOTPATH", "0")
    elif hotpath.load() is None:
        pytest.skip(f"the compiled hot path is not in use ({hotpath.status()})")
    return str(request.param)
