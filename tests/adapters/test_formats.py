"""Every format in LMCache's registry: served on CPU, or refused by name before any copy; and
the compatibility table in docs/formats.md is the one LMCache's registry generates.

Runs under every installed LMCache (the test job runs it under 0.5.6 and 0.5.7rc2); the doc
holds one section per version, and each venv checks its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvactors.core.layouts import KVFormat

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def _formats_table() -> Any:
    """The doc generator (``scripts/formats_table.py``: a lab script, not in the package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "formats_table.py"
    spec = importlib.util.spec_from_file_location("formats_table", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _specs() -> list[tuple[Any, Any]]:
    from lmcache.v1.gpu_connector.kv_format.specs.registry import SPECS

    return sorted(SPECS.items(), key=lambda item: int(item[0]))


def test_the_compatibility_table_is_current() -> None:
    ft = _formats_table()
    version = ft.installed_version()
    doc = ft.DOC.read_text()
    want = ft.section(version)
    assert ft.update(doc, version, want) == doc, (
        f"docs/formats.md is not what LMCache {version}'s format registry generates (a new "
        "format, or a change in what kvactors serves). Regenerate it under this LMCache with "
        "`.venv/bin/python scripts/formats_table.py --write` and review the diff"
    )


def test_the_table_section_is_replaced_or_appended() -> None:
    ft = _formats_table()
    begin, end = (
        "<!-- formats-table lmcache=9.9 begin -->",
        "<!-- formats-table lmcache=9.9 end -->",
    )
    doc = f"# t\n\n{begin}\nold\n{end}\n\nafter\n"
    assert ft.update(doc, "9.9", f"{begin}\nnew\n{end}") == f"# t\n\n{begin}\nnew\n{end}\n\nafter\n"
    assert ft.update("# t\n", "9.9", "S") == "# t\n\nS\n"


def test_served_formats_are_the_ones_kvactors_moves() -> None:
    from kvactors_lmcache.convert import served_as

    served = {int(f) for f, _ in _specs() if served_as(int(f)) is not None}
    # kvactors' own formats (each in test_differential_cpu.py) and LMCache's singleton-axis
    # formats present in this version (test_lmcache_057_path.py).
    singleton = {15, 19} & {int(f) for f, _ in _specs()}
    assert served == {int(f) for f in KVFormat} | singleton


def _refused() -> list[Any]:
    if LMCACHE_MISSING:
        return []
    from kvactors_lmcache.convert import served_as

    return [
        pytest.param(fmt, spec, id=fmt.name)
        for fmt, spec in _specs()
        if served_as(int(fmt)) is None
    ]


@pytest.mark.parametrize(("fmt", "spec"), _refused())
def test_refused_formats_name_the_format_and_the_engine_untouched(fmt: Any, spec: Any) -> None:
    import lmcache.lmcache_native as native

    from kvactors_lmcache.ops import KvactorsCpuOps

    ops = KvactorsCpuOps()
    sd = ops.PageBufferShapeDesc()
    sd.kv_size, sd.nl, sd.nb, sd.bs, sd.nh, sd.hs, sd.element_size = 1, 2, 4, 2, 1, 8, 2
    sd.dtype = torch.bfloat16
    layers = [torch.ones(4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    objs = [torch.zeros(2, 4, 8, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="kvactors does not serve engine_kv_format") as e:
        ops.multi_layer_block_kv_transfer(
            layers, objs, [0, 1], torch.device("cpu"), native.TransferDirection.D2H, sd, 4, fmt, 0
        )
    message = str(e.value)
    assert fmt.name in message
    assert spec.attention_backends[0] in message
    assert "LMCache's own backend" in message
    assert all(not o.any() for o in objs)
    assert all(bool((t == 1).all()) for t in layers)
