"""The public API is explicit: every public name defined in a public module is in __all__."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "kvactors",
    "kvactors.errors",
    "kvactors.runtime",
    "kvactors.core.ordering",
    "kvactors.core.pointers",
    "kvactors.core.layouts",
    "kvactors.core.plans",
    "kvactors.core.protocols.stream",
    "kvactors.core.protocols.gather",
    "kvactors.core.protocols.ipc",
    "kvactors.core.protocols.codec",
    "kvactors.actors.actor",
    "kvactors.actors.reply",
    "kvactors.actors.stream",
    "kvactors.actors.gather",
    "kvactors.actors.ipc_owner",
    "kvactors.actors.group",
    "kvactors.devices.base",
    "kvactors.devices.cpu",
    "kvactors.devices.cpu.backend",
    "kvactors.testing",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_every_public_definition(name: str) -> None:
    mod = importlib.import_module(name)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), "exported twice"
    for attr in exported:
        assert hasattr(mod, attr), f"{name}.__all__ names missing {attr}"
    for attr, value in vars(mod).items():
        if attr.startswith("_") or not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if getattr(value, "__module__", None) == name:
            assert attr in exported, f"{name}.{attr} is public but not in __all__"
