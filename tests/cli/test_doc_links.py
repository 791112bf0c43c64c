"""Every relative link in README.md and docs/ resolves: files, directories and #anchors."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Documents allowed to be missing (none: every linked document exists).
PENDING: set[str] = set()

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")


def _strip_code(text: str) -> str:
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _slug(heading: str) -> str:
    # GitHub's anchor rule: lowercase, drop punctuation except '-' and '_', spaces to '-'.
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: pathlib.Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(_strip_code(path.read_text()))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: pathlib.Path) -> None:
    broken = []
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = (doc.parent / target).resolve() if target else doc
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if rel not in PENDING:
                broken.append(f"{link} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{link} (no heading #{anchor} in {rel})")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_the_checker_sees_links_and_anchors(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text(
        "# Top `x` (y)\n## Top x y\n[a](b.md#z) ![i](img.png) `[no](c.md)`\n```\n[no](d.md)\n```\n"
    )
    assert _links(doc) == ["b.md#z", "img.png"]
    assert _anchors(doc) == {"top-x-y", "top-x-y-1"}


def test_readme_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/kvactors demo" in text
    assert "bash scripts/test.sh" in text
    assert "docs/img/bench.png" in text
    assert (ROOT / "docs/img/bench.png").read_bytes().startswith(b"\x89PNG")


# ---- names: every `python -m X`, import line and dotted kvactors name in README/docs resolves

_FIRST_PARTY = ("kvactors", "kvactors_lmcache")
_PY_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_FROM = re.compile(r"^\s*from ([A-Za-z_][\w.]*) import ([\w, ]+?)\s*(?:#.*)?$", re.M)
_IMPORT = re.compile(r"^\s*import ([A-Za-z_][\w.]*)\s*(?:#.*)?$", re.M)
_DOTTED = re.compile(r"(?<![\w./-])(kvactors(?:_lmcache)?(?:\.[A-Za-z_]\w*)+)")
# Dotted names that are not Python objects: entry-point groups, logger names.
# Entry-point groups and logger names, not importable objects.
_NOT_OBJECTS = {"kvactors.baselines", "kvactors.demo", "kvactors.native_kernels"}


def _first_party(name: str, tops: tuple[str, ...] = _FIRST_PARTY) -> bool:
    return name.split(".")[0] in tops


def _resolve(dotted: str) -> bool:
    """Whether ``dotted`` is an importable module or an attribute path inside one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _runnable(module: str) -> bool:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        return importlib.util.find_spec(f"{module}.__main__") is not None
    return True


def _name_problems(text: str, tops: tuple[str, ...] = _FIRST_PARTY) -> list[str]:
    """The documented names under the top-level packages ``tops`` that do not resolve."""
    bad = []
    for mod in _PY_M.findall(text):
        if _first_party(mod, tops) and not _runnable(mod):
            bad.append(f"python -m {mod}")
    for mod, names in _FROM.findall(text):
        if _first_party(mod, tops):
            bad += [
                f"from {mod} import {n}"
                for n in (x.strip() for x in names.split(","))
                if n and not _resolve(f"{mod}.{n}")
            ]
    for mod in _IMPORT.findall(text):
        if _first_party(mod, tops) and not _resolve(mod):
            bad.append(f"import {mod}")
    for dotted in set(_DOTTED.findall(text)) - _NOT_OBJECTS:
        if _first_party(dotted, tops) and not _resolve(dotted.rstrip(".")):
            bad.append(dotted)
    return sorted(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_modules_and_names_resolve(doc: pathlib.Path) -> None:
    problems = _name_problems(doc.read_text(), ("kvactors",))
    assert not problems, f"{doc.relative_to(ROOT)}: broken names"


# The adapter's modules import lmcache, so its names resolve only where lmcache is installed:
# the test job runs this in the LMCache venvs; the torch matrix (no lmcache) deselects it.
@pytest.mark.lmcache
@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="lmcache not installed")
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_adapter_names_resolve(doc: pathlib.Path) -> None:
    problems = _name_problems(doc.read_text(), ("kvactors_lmcache",))
    assert not problems, f"{doc.relative_to(ROOT)}: broken names"


def test_the_name_checker_sees_broken_names() -> None:
    text = (
        "python -m kvactors.cli.validate\npython -m kvactors.no_such\n"
        "    from kvactors.observe.kvdump import dump_paged, nope\nimport kvactors.gone\n"
        "see `kvactors.observe.metrics.snapshot` and `kvactors.observe.metrics.missing`\n"
    )
    assert _name_problems(text) == [
        "from kvactors.observe.kvdump import nope",
        "import kvactors.gone",
        "kvactors.gone",
        "kvactors.no_such",
        "kvactors.observe.metrics.missing",
        "python -m kvactors.no_such",
    ]
