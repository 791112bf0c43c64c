"""``kvactors validate-serving``: the serving validation, run in the engine's environment.

kvactors never imports lmcache or vllm, so this command starts the procedure
(``python -m kvactors_serving``) with the engine's Python: ``--python``, else
``.venv-vllm/bin/python`` when it exists (``scripts/setup-engine.sh``), else this interpreter.
The procedure is the deployment harness in a checkout's ``tools/`` folder, which the wheel does
not ship: ``--tools``, else ``./tools``, else the ``tools/`` of the checkout this kvactors is
imported from goes first on the procedure's ``PYTHONPATH``. Every other argument goes to the
procedure; see ``docs/validation.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

__all__ = ("add_arguments", "engine_python", "harness_folder", "run")

MODULE = "kvactors_serving"

CHECKOUT_TOOLS = Path(__file__).resolve().parents[2] / "tools"
"""Where the harness is when this kvactors is imported from a checkout (an editable install)."""

NO_HARNESS = (
    "kvactors validate-serving: the serving harness (tools/kvactors_serving) is not here. It is "
    "part of kvactors' source tree, not of the installed package: run the command from a "
    "checkout of kvactors, or pass --tools with the checkout's tools/ folder."
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command's own flags; the rest (``--help`` too) are the procedure's, passed through."""
    ap.add_argument(
        "--python",
        default=None,
        help="the engine environment's interpreter (default: .venv-vllm/bin/python if present)",
    )
    ap.add_argument(
        "--tools",
        default=None,
        metavar="DIR",
        help="a kvactors checkout's tools/ folder, which holds the harness (default: ./tools, "
        "else the checkout kvactors is imported from)",
    )


def engine_python(explicit: str | None) -> str:
    """The interpreter that runs the procedure."""
    if explicit:
        return explicit
    venv = Path(".venv-vllm/bin/python")
    return str(venv) if venv.exists() else sys.executable


def harness_folder(explicit: str | None) -> Path | None:
    """The folder holding the ``kvactors_serving`` package; None when there is none."""
    candidates = [Path(explicit)] if explicit else [Path("tools"), CHECKOUT_TOOLS]
    for folder in candidates:
        if (folder / MODULE / "__main__.py").is_file():
            return folder.resolve()
    return None


def run(args: argparse.Namespace) -> int:
    """Run the procedure; its exit status (0: no check failed, 1: a check failed, 2: no
    harness to run)."""
    folder = harness_folder(args.tools)
    if folder is None:
        where = f" (--tools {args.tools} holds no {MODULE} package)" if args.tools else ""
        print(NO_HARNESS + where, file=sys.stderr)
        return 2
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *paths])}
    cmd = [engine_python(args.python), "-m", MODULE, *args.procedure_args]
    return subprocess.run(cmd, check=False, env=env).returncode
