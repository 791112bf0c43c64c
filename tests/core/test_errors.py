"""errors.py's promise, kept: every exception kvactors raises on purpose is a kvactors error.

An AST scan over ``kvactors/`` (the fakes excluded) and the adapter: every ``raise Name(...)``
names a class of ``kvactors.errors`` or a factory annotated to return one; ``AssertionError``
marks an invariant, ``SystemExit`` a ``__main__`` exit; bare re-raises are not new raises.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import kvactors
from kvactors import errors

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = set(errors.__all__) | {"AssertionError", "SystemExit"}


def _raised_names(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "?")
            out.append((node.lineno, name))
    return out


def _error_factories(source: str) -> set[str]:
    """Functions annotated to return a kvactors error (``-> OperandTypeError``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.returns is not None:
            ret = node.returns
            name = ret.id if isinstance(ret, ast.Name) else getattr(ret, "attr", "?")
            if name in ALLOWED:
                out.add(node.name)
    return out


def _bare_raises(source: str) -> list[tuple[int, str]]:
    allowed = ALLOWED | _error_factories(source)
    return [
        (ln, n) for ln, n in _raised_names(source) if n not in allowed and not n.startswith("_")
    ]


SCANNED = [
    *(
        p
        for p in sorted((ROOT / "kvactors").rglob("*.py"))
        if "testing" not in p.relative_to(ROOT / "kvactors").parts
    ),
    *sorted((ROOT / "adapters" / "kvactors_lmcache").rglob("*.py")),
]


def test_every_raise_in_kvactors_and_the_adapter_names_a_kvactors_error() -> None:
    assert any(p.parent.name == "kvactors_lmcache" for p in SCANNED)
    bad = {}
    for path in SCANNED:
        hits = _bare_raises(path.read_text())
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"raise a kvactors.errors class instead: {bad}"


def test_the_scan_sees_a_bare_builtin_raise() -> None:
    src = (
        "def f(x):\n    if x:\n        raise ValueError('no')\n"
        "    raise errors.InvalidSettingError('no', setting='x')\n"
    )
    assert sorted(_raised_names(src)) == [(3, "ValueError"), (4, "InvalidSettingError")]
    assert _bare_raises(src) == [(3, "ValueError")]


def test_the_scan_accepts_a_factory_only_when_it_returns_a_kvactors_error() -> None:
    src = (
        "def refuse(p: int) -> OperandTypeError:\n    return OperandTypeError('no')\n"
        "def other(p: int) -> ValueError:\n    return ValueError('no')\n"
        "def f(p):\n    raise refuse(p)\n\ndef g(p):\n    raise other(p)\n"
    )
    assert _bare_raises(src) == [(9, "other")]


@pytest.mark.parametrize(
    ("make", "builtin"),
    [
        ("stream_ptr", TypeError),
        ("alignments", ValueError),
        ("host_pointer", ValueError),
        ("ops_class", ValueError),
    ],
)
def test_the_adapter_s_errors_keep_their_builtin_compatibility(make: str, builtin: type) -> None:
    pytest.importorskip("lmcache")
    from kvactors_lmcache import ops

    calls = {
        "stream_ptr": lambda: ops.KvactorsDeviceOps.record_completion_on_stream(
            object.__new__(ops.KvactorsDeviceOps),
            "0",  # type: ignore[arg-type]
            "k",
            b"",
        ),
        "alignments": lambda: ops.KvactorsDeviceOps.lmcache_memcpy_async(
            object.__new__(ops.KvactorsDeviceOps), 1, 2, 8, 0, 0, 3
        ),
        "host_pointer": lambda: ops._host_bytes(0, 8),
        "ops_class": lambda: ops.ops_class_for("tpu"),
    }
    with pytest.raises(builtin) as info:
        calls[make]()
    assert isinstance(info.value, errors.KvactorsError)


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_is_a_kvactors_error_exported_at_the_top(name: str) -> None:
    obj = getattr(errors, name)
    if not isinstance(obj, type):
        return  # the translate helpers
    assert issubclass(obj, errors.KvactorsError)
    assert getattr(kvactors, name) is obj


def test_translate_keeps_kvactors_errors_and_chains_foreign_ones() -> None:
    def make(m: str) -> errors.KvactorsError:
        return errors.DeviceOpError(m, device="mlu:0", op="sync")

    mine = errors.IPCError("mine")
    assert errors.translate(mine, make) is mine
    foreign = RuntimeError("cnrt failure")
    got = errors.translate(foreign, make)
    assert isinstance(got, errors.DeviceOpError)
    assert got.__cause__ is foreign
    assert str(got) == "mlu:0 sync: cnrt failure"
    with pytest.raises(errors.DeviceOpError) as info, errors.translating(make):
        raise OSError("gone")
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(KeyError), errors.translating(make):  # not foreign: a bug, passes
        raise KeyError("x")
