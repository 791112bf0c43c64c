"""The dead-code check (scripts/test.sh runs vulture once): its whitelist stays honest.

vulture cannot tell a needed whitelist entry from a stale one, so this test does: every entry
must carry a reason, and must name something still defined under kvactors/, adapters/ or
tools/ (a deleted or renamed name leaves an entry that would silently excuse a future dead
one).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHITELIST = ROOT / "vulture_whitelist.py"


def _entries() -> list[tuple[int, str, str]]:
    out = []
    for n, line in enumerate(WHITELIST.read_text().splitlines(), 1):
        if line.startswith("_."):
            code, _, reason = line.partition("#")
            out.append((n, code.strip()[2:], reason.strip()))
    return out


def _defined_names() -> set[str]:
    names: set[str] = set()
    for base in ("kvactors", "adapters", "tools"):
        for path in (ROOT / base).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                    names.update(a.arg for a in (*node.args.posonlyargs, *node.args.args))
                elif isinstance(node, ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    return names


def test_every_whitelist_entry_has_a_reason_and_a_definition() -> None:
    entries = _entries()
    assert len(entries) > 10
    defined = _defined_names()
    for n, name, reason in entries:
        assert reason, f"vulture_whitelist.py:{n}: {name} has no reason"
        assert name in defined, f"vulture_whitelist.py:{n}: {name} is defined nowhere (stale)"


@pytest.mark.skipif(importlib.util.find_spec("vulture") is None, reason="vulture not installed")
def test_vulture_finds_an_orphan(tmp_path: Path) -> None:
    """The check is live at the job's confidence: a function nothing calls is reported (the
    tree itself is checked once, by scripts/test.sh's vulture phase)."""
    import subprocess
    import sys

    orphan = tmp_path / "orphan.py"
    orphan.write_text("def orphan_helper() -> int:\n    return 1\n")
    cmd = [sys.executable, "-m", "vulture", "--min-confidence", "60", str(orphan)]
    dirty = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert dirty.returncode != 0
    assert "orphan_helper" in dirty.stdout
