"""The test tree's own rules: it mirrors the floors, and every helper has one module name.

``scripts/test.sh`` selects tests by directory (which venv and which fake vendor runs them), so
a test file outside the floors' directories would run nowhere it should, or everywhere.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _local_names() -> set[str]:
    """Top-level names a bare import could resolve inside tests/ (helpers and sub-packages)."""
    names = {p.stem for p in TESTS.glob("*.py") if p.stem != "conftest"}
    return names | {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def _bare_imports(source: str, local: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of absolute imports that name a tests/ module without ``tests.``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in local]
    return out


def test_helpers_are_imported_as_tests_dot_name() -> None:
    # `from _transfer_cases import Case` next to `from tests._transfer_cases import Case` makes
    # two modules and two Case classes; import helpers as tests.<name> (or relatively).
    local = _local_names()
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in TESTS.rglob("*.py")
        if (hits := _bare_imports(p.read_text(), local))
    }
    assert not bad


def test_the_scan_sees_a_bare_helper_import() -> None:
    src = "from _transfer_cases import Case\nfrom tests._transfer_cases import raw\nimport os\n"
    assert "_transfer_cases" in _local_names()
    assert _bare_imports(src, _local_names()) == [(1, "_transfer_cases")]


FLOORS = {
    # the floors of docs/architecture.md, and the fakes of kvactors.testing
    "core",
    "kernels",
    "devices",
    "actors",
    "runtime",
    "observe",
    "adapters",
    "cli",
    "testing",
    # rules across floors, deployments with a real engine, and the tree itself
    "scenarios",
    "engine",
    "meta",
}


def _misplaced(tests: pathlib.Path) -> list[str]:
    """Test files at the top of ``tests`` and directories there that are not a floor."""
    loose = [p.name for p in tests.glob("test_*.py")]
    dirs = [
        p.name
        for p in tests.iterdir()
        if p.is_dir() and not p.name.startswith((".", "_")) and p.name not in FLOORS
    ]
    return sorted(loose + [f"{d}/" for d in dirs])


def test_the_tree_mirrors_the_floors() -> None:
    assert _misplaced(TESTS) == []
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and p.name in FLOORS} == FLOORS


def test_the_floor_check_sees_a_loose_file_and_a_stray_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "misc").mkdir()
    (tmp_path / "test_loose.py").write_text("")
    (tmp_path / "_helpers.py").write_text("")
    assert _misplaced(tmp_path) == ["misc/", "test_loose.py"]
