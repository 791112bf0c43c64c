"""Architecture rules checked on the source: the pure core, the lmcache boundary, exports."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


# ---- the naming rule: a module whose name starts with `_` is imported only from inside its
# own package (docs/architecture.md, "Layers"); tests may reach in.

PACKAGES = [ROOT / "kvactors", ROOT / "adapters" / "kvactors_lmcache"]


def _module_name(path: pathlib.Path) -> str:
    base = ROOT / "adapters" if path.is_relative_to(ROOT / "adapters") else ROOT
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    for base in (ROOT, ROOT / "adapters"):
        p = base.joinpath(*name.split("."))
        if p.with_suffix(".py").is_file() or (p / "__init__.py").is_file():
            return True
    return False


def _targets(source: str, importer: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` of every module an import statement names (also lazy, type-only)."""
    here = importer if is_package else importer.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            for a in node.names:  # `from pkg import _mod` names the module pkg._mod
                if _is_module(f"{base}.{a.name}"):
                    out.append((node.lineno, f"{base}.{a.name}"))
    return out


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (``a.b`` for ``a.b._c.d``), or None."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[:i])
    return None


def _naming_rule_violations(source: str, importer: str, is_package: bool) -> list[str]:
    bad = []
    for line, target in _targets(source, importer, is_package):
        if target.split(".")[0] not in ("kvactors", "kvactors_lmcache"):
            continue  # other projects' private modules are theirs to name
        owner = _private_owner(target)
        if owner is not None and not (importer + ".").startswith(owner + "."):
            bad.append(f"{importer}:{line} imports {target} (private to {owner})")
    return bad


def test_private_modules_are_imported_only_from_their_own_package() -> None:
    bad = []
    for pkg in PACKAGES:
        for path in pkg.rglob("*.py"):
            name = _module_name(path)
            bad += _naming_rule_violations(path.read_text(), name, path.stem == "__init__")
    assert not bad, "\n".join(bad)


def test_the_naming_rule_scan_sees_a_reach_into_another_package() -> None:
    src = (
        "from kvactors.runtime import _runtime\n"
        "from kvactors.runtime._runtime import Runtime\n"
        "import kvactors.core._plan_checks\n"
        "from . import _devenv\n"
        "from kvactors.runtime import Runtime\n"
    )
    assert _naming_rule_violations(src, "kvactors.cli.demo", False) == [
        "kvactors.cli.demo:1 imports kvactors.runtime._runtime (private to kvactors.runtime)",
        "kvactors.cli.demo:2 imports kvactors.runtime._runtime (private to kvactors.runtime)",
        "kvactors.cli.demo:3 imports kvactors.core._plan_checks (private to kvactors.core)",
    ]
    assert _naming_rule_violations(src, "kvactors.runtime._runtime", False)[-1].startswith(
        "kvactors.runtime._runtime:3"
    )


def test_the_layer_table_names_paths_that_exist() -> None:
    # docs/architecture.md's floors name packages and modules by path: each one is there.
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Layers") : text.index("**Naming rule.**")]
    paths = set(re.findall(r"`((?:kvactors|adapters)/[\w/.]*)`", table))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing
