"""KV bit-equality: dumps of stored and restored KV, compared per layer and block."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.cli import main
from kvactors.cli.validate import KVDump, compare_kv, dump_paged, load_dump, save_dump
from kvactors.core.layouts import KVFormat

if TYPE_CHECKING:
    import pathlib


def _layers(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_identical_dumps_pass(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    paged = _layers()
    stored = dump_paged(paged, int(KVFormat.NL_X_TWO_NB_BS_NH_HS), [4, 1, 5])
    restored = KVDump((0, 2, 3), [t.clone() for t in stored.layers], stored.block_dim)
    save_dump(stored, str(tmp_path / "a"))
    save_dump(restored, str(tmp_path / "b"))
    assert main(["validate", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "IDENTICAL" in capsys.readouterr().out


def test_one_flipped_bit_is_reported_with_layer_and_block(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paged = _layers()
    stored = dump_paged(paged, int(KVFormat.NL_X_TWO_NB_BS_NH_HS), [4, 1, 5])
    bad = [t.clone() for t in stored.layers]
    bad[2].view(torch.int16)[1, 2, 0, 0, 3] ^= 1  # layer 2, plane V, block position 2
    save_dump(stored, str(tmp_path / "a"))
    save_dump(KVDump(stored.block_ids, bad, stored.block_dim), str(tmp_path / "b"))
    assert main(["validate", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out
    assert "layer 2 position 2 (stored block 5, restored block 5): 1/" in out


def test_nan_bits_compare_exactly() -> None:
    a = torch.full((1, 2, 3), float("nan"))
    b = a.clone()
    r = compare_kv(KVDump((0, 1), [a], 1), KVDump((0, 1), [b], 1))
    assert r.ok
    b[0, 1, 0] = -0.0
    a[0, 1, 0] = 0.0
    assert not compare_kv(KVDump((0, 1), [a], 1), KVDump((0, 1), [b], 1)).ok


@pytest.mark.parametrize(
    ("fmt", "make"),
    [
        (
            KVFormat.NB_NL_TWO_BS_NH_HS,
            lambda: torch.arange(6 * 3 * 2 * 4 * 2 * 2.0).reshape(6, 3, 2, 4, 2, 2),
        ),
        (
            KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
            lambda: [
                [torch.arange(48.0).reshape(6, 4, 2) + 100 * i for i in range(3)],
                [torch.arange(48.0).reshape(6, 4, 2) - 100 * i for i in range(3)],
            ],
        ),
        (
            KVFormat.NL_X_TWO_X_NB_BS_NH_HS,
            lambda: [
                (
                    torch.arange(48.0).reshape(6, 4, 2) + 100 * i,
                    -torch.arange(48.0).reshape(6, 4, 2),
                )
                for i in range(3)
            ],
        ),
    ],
)
def test_dump_paged_layouts(fmt: KVFormat, make: object) -> None:
    paged = make()  # type: ignore[operator]
    d = dump_paged(paged, int(fmt), [5, 0])
    assert len(d.layers) == 3
    for t in d.layers:
        assert t.shape[d.block_dim] == 2
    assert compare_kv(d, dump_paged(paged, int(fmt), [5, 0])).ok
    assert not compare_kv(d, dump_paged(paged, int(fmt), [0, 5])).ok


def test_bad_file_is_exit_2(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x"
    torch.save({"nope": 1}, str(p))
    with pytest.raises(ValueError, match="not a kvactors KV dump"):
        load_dump(str(p))
    assert main(["validate", str(p), str(p)]) == 2
