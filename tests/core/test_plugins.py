"""One source of truth for the LMCache plugin names: ``kvactors.core.plugins``."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib

from kvactors.core.plugins import ENTRY_POINT_GROUP, PLUGINS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyproject_entry_points_are_exactly_the_plugin_names() -> None:
    # What LMCache sees: the installed distribution's entry points (from pyproject.toml).
    dist = importlib.metadata.distribution("kvactors")
    eps = {ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
    assert eps == set(PLUGINS), "pyproject.toml differs (or reinstall: pip install -e .)"


def _spelled_names(path: pathlib.Path, names: set[str]) -> list[int]:
    """Lines where one of ``names`` appears as a whole string literal (docstrings excepted)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    ]


def test_no_module_spells_a_plugin_name_itself() -> None:
    # "mlu" is also a device kind, so only the names that are nothing but plugin names count.
    names = {n for n in PLUGINS if n.startswith("kvactors_")}
    found = {
        str(p.relative_to(ROOT)): lines
        for top in ("kvactors", "adapters")
        for p in (ROOT / top).rglob("*.py")
        if p.name != "plugins.py" and (lines := _spelled_names(p, names))
    }
    assert not found, f"plugin names spelled outside kvactors/core/plugins.py: {found}"


def test_the_scan_sees_a_spelled_name(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text('"""kvactors_cpu in a docstring is fine."""\nNAME = "kvactors_cpu"\n')
    assert _spelled_names(src, {"kvactors_cpu"}) == [2]
