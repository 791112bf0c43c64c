"""The torch versions the test job runs, and what ``kvactors doctor`` says about this one.

On MLU and MUSA hosts torch comes from the vendor's stack and must not be replaced, and those
stacks trail upstream torch; so the doctor says whether the installed torch is inside the range
the test job proves, and what to do when it is not.
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = (
    "TORCH_TESTED",
    "TorchPlacement",
    "placement_line",
    "torch_placement",
    "torch_range_advice",
)

TORCH_TESTED = ((2, 7), (2, 13))
"""The oldest and newest torch (major, minor) the test job runs: ``scripts/setup.sh``'s floor
lane (2.7.1, what Cambricon's vLLM-MLU pins and the oldest torch torch_musa ships for) and torch
2.13.0. ``pyproject.toml`` declares the oldest as its floor."""

TorchPlacement = Literal["inside", "older", "newer", "unknown"]

_VERSION = re.compile(r"(\d+)\.(\d+)")


def _text(mm: tuple[int, int]) -> str:
    return f"{mm[0]}.{mm[1]}"


_RELATION = {"inside": "inside", "older": "older than", "newer": "newer than"}


def placement_line(version: str, placement: str) -> str:
    """One line for the doctor's text: ``torch 2.9.1: inside the tested range 2.7-2.13``."""
    lo, hi = _text(TORCH_TESTED[0]), _text(TORCH_TESTED[1])
    relation = _RELATION.get(placement, "unreadable against")
    return f"torch {version}: {relation} the tested range {lo}-{hi}"


def torch_placement(version: str) -> TorchPlacement:
    """Where a torch version string (``"2.5.1+cu121"``, ``"2.4.0a0+git..."``) lies against
    :data:`TORCH_TESTED`; ``unknown`` when it has no leading ``major.minor``."""
    match = _VERSION.match(version.strip())
    if match is None:
        return "unknown"
    mm = (int(match.group(1)), int(match.group(2)))
    if mm < TORCH_TESTED[0]:
        return "older"
    if mm > TORCH_TESTED[1]:
        return "newer"
    return "inside"


def torch_range_advice(
    version: str, vendors: dict[str, str | None]
) -> tuple[Literal["ok", "warn"], str, str]:
    """``(level, message, fix)`` for the doctor's torch finding.

    Args:
        version: The running torch's ``__version__``.
        vendors: ``torch_mlu`` / ``torch_musa`` -> installed version or None.
    """
    lo, hi = _text(TORCH_TESTED[0]), _text(TORCH_TESTED[1])
    installed = [k for k, v in vendors.items() if v]
    what = f"torch {version}" + (
        f" (with {', '.join(f'{k} {vendors[k]}' for k in installed)})" if installed else ""
    )
    check = "run `kvactors selftest --device cpu|mlu|musa` (`--fake` for the vendor fakes)"
    placement = torch_placement(version)
    if placement == "inside":
        return "ok", f"{what} is inside the tested range {lo}-{hi}", ""
    if placement == "older":
        fix = (
            f"upgrade the whole vendor stack to one on torch >= {lo} (Cambricon's vLLM-MLU with "
            "torch_mlu >= 1.27 runs on PyTorch 2.7.1; torch_musa ships for 2.7.1, 2.9.1 and "
            "2.11); never replace "
            f"{' or '.join(installed)}'s torch alone"
            if installed
            else f"pip install 'torch>={lo},<{TORCH_TESTED[1][0]}.{TORCH_TESTED[1][1] + 1}' (on an "
            "MLU or MUSA host, the vendor's stack instead)"
        )
        return (
            "warn",
            f"{what} is older than the oldest torch kvactors is tested on ({lo}; tested "
            f"{lo}-{hi}); kvactors declares torch>={lo}",
            fix,
        )
    if placement == "newer":
        fix = (
            f"keep the vendor stack's torch and {check} here"
            if installed
            else f"{check} here, or install torch {hi} where you choose torch"
        )
        return (
            "warn",
            f"{what} is newer than the newest torch kvactors is tested on ({hi}; tested {lo}-{hi})",
            fix,
        )
    return "warn", f"{what}: cannot read a major.minor version (tested {lo}-{hi})", f"{check}"
