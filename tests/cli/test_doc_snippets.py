"""The code blocks the docs mark ``<!-- test: runs -->`` run as written and exit 0.

The README's "Use it" block (a ``TransferRequest`` built from scratch, a store and a retrieve
through a CPU runtime) and the ``ManualBackend`` walk-through of ``docs/testing.md`` are such
blocks: each runs in its own interpreter, in an empty directory, against this checkout.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_BLOCK = re.compile(r"^<!-- test: runs -->\n```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, m in enumerate(_BLOCK.finditer(doc.read_text())):
            out.append((f"{doc.relative_to(ROOT)}#{i}", m.group(1)))
    return out


def test_the_marked_blocks_include_the_readme_and_the_manual_backend() -> None:
    found = dict(_blocks())
    readme = [code for name, code in found.items() if name.startswith("README.md")]
    assert any("TransferRequest(" in code for code in readme)
    testing = [code for name, code in found.items() if name.startswith("docs/testing.md")]
    assert any("ManualBackend()" in code for code in testing)


@pytest.mark.parametrize(("name", "code"), _blocks(), ids=[n for n, _ in _blocks()])
def test_marked_block_runs(name: str, code: str, tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, f"{name}\n{proc.stdout}\n{proc.stderr}"
