"""``kvactors validate-serving``: the serving validation, run in the engine's environment.

kvactors never imports lmcache or vllm, so this command starts the procedure
(``python -m kvactors_lmcache.serving``, in the adapter package) with the engine's Python:
``--python``, else ``.venv-vllm/bin/python`` when it exists (``scripts/setup-engine.sh``), else
this interpreter. Every other argument goes to the procedure; see ``docs/validation.md``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ("add_arguments", "engine_python", "run")

MODULE = "kvactors_lmcache.serving"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command's own flag; the rest (``--help`` too) are the procedure's, passed through."""
    ap.add_argument(
        "--python",
        default=None,
        help="the engine environment's interpreter (default: .venv-vllm/bin/python if present)",
    )


def engine_python(explicit: str | None) -> str:
    """The interpreter that runs the procedure."""
    if explicit:
        return explicit
    venv = Path(".venv-vllm/bin/python")
    return str(venv) if venv.exists() else sys.executable


def run(args: argparse.Namespace) -> int:
    """Run the procedure; its exit status (0: no check failed, 1: a check failed)."""
    python = engine_python(args.python)
    cmd = [python, "-m", MODULE, *args.procedure_args]
    return subprocess.run(cmd, check=False).returncode
