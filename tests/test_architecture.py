"""Architecture rules checked on the source: the pure core, the lmcache boundary, exports."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PURE = [
    "kvactors/core/ordering.py",
    "kvactors/core/plans.py",
    "kvactors/core/layouts.py",
    "kvactors/core/pointers.py",
    "kvactors/core/protocols/_base.py",
    "kvactors/core/protocols/stream.py",
    "kvactors/core/protocols/gather.py",
    "kvactors/core/protocols/ipc.py",
    "kvactors/core/protocols/codec.py",
]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_pure_core_has_no_asyncio_or_threads() -> None:
    for rel in PURE:
        mods = _imports(ROOT / rel)
        bad = {m for m in mods if m.split(".")[0] in {"asyncio", "threading", "anyio"}}
        assert not bad, f"{rel} imports {bad}"


def test_runtime_never_imports_lmcache() -> None:
    for path in (ROOT / "kvactors").rglob("*.py"):
        mods = _imports(path)
        assert not {m for m in mods if m.split(".")[0] == "lmcache"}, path
