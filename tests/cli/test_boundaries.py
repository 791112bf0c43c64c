"""The user-surface modules: no lmcache import anywhere in kvactors, explicit public API."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SURFACE = [
    "kvactors.cli",
    "kvactors.cli.doctor",
    "kvactors.cli.demo",
    "kvactors.cli.bench.command",
    "kvactors.cli.replay",
    "kvactors.observe.metrics",
    "kvactors.observe.logs",
    "kvactors.observe.trace",
    "kvactors.cli.validate",
    "kvactors.observe.kvdump",
    "kvactors.observe",
    "kvactors.core.plugins",
]


def _lmcache_imports(path: pathlib.Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        if any(n.split(".")[0] == "lmcache" for n in names):
            lines.append(getattr(node, "lineno", 0))
    return lines


def test_kvactors_never_imports_lmcache() -> None:
    # ast.walk visits imports at any depth: inside functions, try blocks, conditionals.
    bad = {
        str(p.relative_to(ROOT)): ln
        for p in (ROOT / "kvactors").rglob("*.py")
        if (ln := _lmcache_imports(p))
    }
    assert not bad


def test_the_scan_catches_indented_and_dynamic_imports(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    if True:\n        from lmcache.v1 import x\n"
        "import importlib\nimportlib.import_module('lmcache')\n"
    )
    assert sorted(_lmcache_imports(src)) == [3, 5]


@pytest.mark.parametrize("name", SURFACE)
def test_public_api_is_in_all(name: str) -> None:
    mod = importlib.import_module(name)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__)
    for attr, value in vars(mod).items():
        if attr.startswith("_") or not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if getattr(value, "__module__", None) == name:
            assert attr in exported, f"{name}.{attr} is public but not in __all__"
