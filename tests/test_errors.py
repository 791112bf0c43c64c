"""errors.py's promise, kept: every exception kvactors raises on purpose is a kvactors error.

A source scan (AST) over ``kvactors/`` (the public fakes in ``kvactors/testing`` imitate vendor
errors and are excluded): every ``raise Name(...)`` names a class of ``kvactors.errors``;
``AssertionError`` marks an invariant (``unreachable``), ``SystemExit`` a ``__main__`` exit.
Re-raising a caught or stored exception (``raise``, ``raise exc``) is not a new raise.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import kvactors
from kvactors import errors

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = set(errors.__all__) | {"AssertionError", "SystemExit"}


def _raised_names(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "?")
            out.append((node.lineno, name))
    return out


def test_every_raise_in_kvactors_names_a_kvactors_error() -> None:
    bad = {}
    for path in sorted((ROOT / "kvactors").rglob("*.py")):
        if "testing" in path.relative_to(ROOT / "kvactors").parts:
            continue
        hits = [(ln, n) for ln, n in _raised_names(path.read_text())
                if n not in ALLOWED and not n.startswith("_")]
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"raise a kvactors.errors class instead: {bad}"


def test_the_scan_sees_a_bare_builtin_raise() -> None:
    src = ("def f(x):\n    if x:\n        raise ValueError('no')\n"
           "    raise errors.InvalidSettingError('no', setting='x')\n")
    assert sorted(_raised_names(src)) == [(3, "ValueError"), (4, "InvalidSettingError")]


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_kvactors_error_exported_at_the_top(name: str) -> None:
    obj = getattr(errors, name)
    if not isinstance(obj, type):
        return  # the translate helpers
    assert issubclass(obj, errors.KvactorsError)
    assert getattr(kvactors, name) is obj


def test_translate_keeps_kvactors_errors_and_chains_foreign_ones() -> None:
    def make(m: str) -> errors.KvactorsError:
        return errors.DeviceOpError(m, device="mlu:0", op="sync")

    mine = errors.IPCError("mine")
    assert errors.translate(mine, make) is mine
    foreign = RuntimeError("cnrt failure")
    got = errors.translate(foreign, make)
    assert isinstance(got, errors.DeviceOpError)
    assert got.__cause__ is foreign
    assert str(got) == "mlu:0 sync: cnrt failure"
    with pytest.raises(errors.DeviceOpError) as info, errors.translating(make):
        raise OSError("gone")
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(KeyError), errors.translating(make):  # not foreign: a bug, passes
        raise KeyError("x")
