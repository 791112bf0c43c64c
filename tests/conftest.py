"""Suite-wide settings: one intra-op thread (stable, no OpenMP stalls on 2 cores)."""

from __future__ import annotations

import importlib.util

import torch

torch.set_num_threads(1)

pytest_plugins = (
    ["kvactors.testing.pytest_plugin"]
    if importlib.util.find_spec("kvactors.testing.pytest_plugin") is not None
    else []
)
