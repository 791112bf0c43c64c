"""``kvactors_lmcache.vllm_cpu.patch_llvmlite_lib``: the workaround the offline ``LLM`` API on
vLLM's CPU build needs (README, docs/troubleshooting.md), shipped in the wheel."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [
    pytest.mark.lmcache,
    pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON),
    pytest.mark.skipif(importlib.util.find_spec("llvmlite") is None, reason="no llvmlite here"),
]


SCRIPT = """
from llvmlite.binding import ffi
from kvactors_lmcache.vllm_cpu import patch_llvmlite_lib
try:
    vars(ffi.lib).get("kernel")
    before = "ok"
except AttributeError as exc:
    before = str(exc)
first = patch_llvmlite_lib()
print(before, first, vars(ffi.lib).get("kernel"), patch_llvmlite_lib(), sep="|")
print(callable(ffi.lib.LLVMPY_GetVersionInfo))
"""


def test_the_llvmlite_library_answers_vars_with_a_mapping_once_patched() -> None:
    """vLLM's CPU platform runs ``vars(value).get("kernel")`` over module globals; in a fresh
    process llvmlite's library object fails it until patched, and its functions still
    resolve after."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    before, first, kernel, second = out[-2].split("|")
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in before
    assert (first, kernel, second) == ("True", "None", "False")
    assert out[-1] == "True"
