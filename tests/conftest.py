"""Suite-wide settings: one intra-op thread (stable, no OpenMP stalls on 2 cores), and the
suite refuses to run against a kvactors installed from another checkout."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
from urllib.parse import unquote, urlparse

import pytest
import torch

torch.set_num_threads(1)

pytest_plugins = (
    ["kvactors.testing.pytest_plugin"]
    if importlib.util.find_spec("kvactors.testing.pytest_plugin") is not None
    else []
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def editable_source() -> pathlib.Path | None:
    """The checkout this venv's kvactors is installed from, when it is an editable install."""
    try:
        text = importlib.metadata.distribution("kvactors").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    info = json.loads(text or "{}")
    if not info.get("dir_info", {}).get("editable"):
        return None
    return pathlib.Path(unquote(urlparse(info["url"]).path)).resolve()


def pytest_configure(config: pytest.Config) -> None:
    # The venvs live in a store shared by the checkouts of a machine (scripts/setup.sh), and the
    # adapter and entry points come from whichever checkout installed itself last: a suite run
    # against another checkout's code would pass or fail for that code, not this one.
    source = editable_source()
    if source is not None and source != ROOT:
        raise pytest.UsageError(
            f"this venv's kvactors is installed from {source}, not from this checkout ({ROOT}): "
            "run `bash scripts/setup.sh --test` here first (scripts/test.sh does)"
        )
