"""KV bit-equality: dumps of stored and restored KV, compared per layer and block."""

from __future__ import annotations

import collections
import os
import random
import types
import zipfile
from typing import TYPE_CHECKING

import pytest
import torch

from kvactors.cli import main
from kvactors.core.layouts import KVFormat
from kvactors.errors import InvalidFileError
from kvactors.observe.kvdump import KVDump, compare_kv, dump_paged, load_dump, save_dump

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


_M = "kvactors_kv_dump"


def _good() -> dict[str, object]:
    return {_M: 1, "block_ids": [4, 1, 5, 0, 2, 3], "block_dim": 1, "layers": _layers()}


def _malformed() -> dict[str, dict[str, object] | object]:
    g = _good()
    layers = g["layers"]
    assert isinstance(layers, list)

    def but(**kw: object) -> dict[str, object]:
        d = {**g, **kw}
        return {k: v for k, v in d.items() if v is not _DROP}

    return {
        "a list": [1, 2],
        "no magic": but(**{_M: _DROP}),
        "magic 2": but(**{_M: 2}),
        "no block_ids": but(block_ids=_DROP),
        "no layers": but(layers=_DROP),
        "no block_dim": but(block_dim=_DROP),
        "an extra key": but(extra=1),
        "block_ids a string": but(block_ids="abc"),
        "block_ids of floats": but(block_ids=[4.0, 1.0, 5.0]),
        "block_ids of bools": but(block_ids=[True, False, True]),
        "block_ids too few": but(block_ids=[4, 1, 5]),
        "block_dim 9": but(block_dim=9),
        "block_dim -1": but(block_dim=-1),
        "block_dim a string": but(block_dim="1"),
        "block_dim a bool": but(block_dim=True),
        "layers empty": but(layers=[]),
        "layers of ints": but(layers=[1, 2, 3]),
        "layers a tensor": but(layers=layers[0]),
        "a 0-dim layer": but(layers=[torch.tensor(1.0)], block_dim=0),
        "a complex128 layer": but(layers=[torch.zeros(2, 3, dtype=torch.complex128)]),
        "a sparse layer": but(layers=[torch.zeros(2, 3).to_sparse()], block_dim=0),
        "layers of unequal blocks": but(layers=[layers[0], layers[1][:, :2]]),
    }


_DROP = object()


@pytest.mark.parametrize("name", sorted(_malformed()))
def test_malformed_dump_is_invalid_file_and_exit_2(
    name: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    torch.save(_good(), str(ok))
    torch.save(_malformed()[name], str(bad))
    assert load_dump(str(ok)).block_ids == (4, 1, 5, 0, 2, 3)  # only the mutation is wrong
    with pytest.raises(InvalidFileError):
        load_dump(str(bad))
    assert main(["validate", str(bad), str(ok)]) == 2
    assert main(["validate", str(ok), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("kvactors validate: ") == 2
    assert "Traceback" not in err


class _Evil:
    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.mark}",))


def test_hostile_and_damaged_files_are_exit_2_and_run_no_code(tmp_path: pathlib.Path) -> None:
    ok = tmp_path / "ok"
    torch.save(_good(), str(ok))
    mark = tmp_path / "PWNED"
    files = {"empty": b"", "random": random.Random(1).randbytes(500)}
    evil = tmp_path / "evil"
    torch.save({**_good(), "x": _Evil(str(mark))}, str(evil))
    files["evil pickle"] = evil.read_bytes()
    for name, data in files.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(InvalidFileError):
            load_dump(str(p))
        assert main(["validate", str(p), str(ok)]) == 2, name
    assert not mark.exists()


def test_bit_flipped_dumps_never_escape_as_other_errors(tmp_path: pathlib.Path) -> None:
    # A seeded loop of byte mutations: every damaged file either still loads as a well-formed
    # dump (a flip in padding or metadata) or is an InvalidFileError; the CLI answers 0, 1 or 2.
    ok = tmp_path / "ok"
    torch.save(_good(), str(ok))
    data = ok.read_bytes()
    rng = random.Random(29)
    invalid = 0
    for i in range(60):
        b = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if i % 5 == 4:
            b = b[: rng.randrange(len(b))]  # truncated as well
        p = tmp_path / f"flip{i}"
        p.write_bytes(bytes(b))
        try:
            load_dump(str(p))
        except InvalidFileError:
            invalid += 1
        assert main(["validate", str(p), str(ok)]) in (0, 1, 2)
    assert invalid > 0


class _View:
    """Pickles as ``torch._utils._rebuild_tensor_v2`` over ``storage`` with any size and stride
    (what ``torch.save`` writes for a view), so a test can write strides ``as_strided`` refuses."""

    def __init__(self, storage: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]):
        typed = torch.storage.TypedStorage(
            wrap_storage=storage.untyped_storage(), dtype=storage.dtype, _internal=True
        )
        self.args: tuple[object, ...] = (typed, 0, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (torch._utils._rebuild_tensor_v2, self.args)


def _hostile_layers() -> dict[str, tuple[object, str]]:
    """Layers whose storage is far smaller than their size: (layer, the refusal's fragment)."""
    one = torch.zeros(1, dtype=torch.int32)
    eight = torch.zeros(8, dtype=torch.int32)
    sixteen = torch.zeros(16, dtype=torch.int32)
    return {
        "stride 0 (a GiB from one element)": (one.expand(2, 2**27), "stride 0 on axis"),
        "stride 0 on one axis": (eight.as_strided((2, 4), (0, 1)), "stride 0 on axis 0"),
        "overlapping rows": (eight.as_strided((2, 6), (1, 1)), "overlapping elements"),
        "overlapping planes": (sixteen.as_strided((2, 2, 4), (2, 4, 1)), "overlapping elements"),
        "past the storage": (_View(eight, (2, 100), (100, 1)), "not a readable"),
    }


@pytest.mark.parametrize("name", sorted(_hostile_layers()))
def test_hostile_strides_are_refused_before_any_comparison(
    name: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvactors.observe import kvdump

    layer, fragment = _hostile_layers()[name]
    bad = tmp_path / "bad"
    torch.save({_M: 1, "block_ids": [0, 1], "block_dim": 0, "layers": [layer]}, str(bad))
    assert bad.stat().st_size < 4096
    with pytest.raises(InvalidFileError, match=fragment) as info:
        load_dump(str(bad))
    assert info.value.path == str(bad)

    def no_bits(t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a hostile layer reached the comparison")

    monkeypatch.setattr(kvdump, "_bits", no_bits)
    assert main(["validate", str(bad), str(bad)]) == 2
    assert fragment in capsys.readouterr().err


def test_dense_views_in_any_axis_order_are_accepted(tmp_path: pathlib.Path) -> None:
    # Permuted and sliced layers are dense without overlap: no false refusal.
    base = torch.arange(48, dtype=torch.int32)
    permuted = base.reshape(4, 3, 4).permute(2, 0, 1)  # [4, 4, 3], strides (1, 12, 4)
    sliced = base.reshape(4, 12)[:, 2:5]  # a slice of a larger storage
    for i, layer in enumerate((permuted, sliced)):
        p = tmp_path / f"v{i}"
        torch.save({_M: 1, "block_ids": [0, 1, 2, 3], "block_dim": 0, "layers": [layer]}, str(p))
        got = load_dump(str(p))
        assert got.layers[0].stride() == layer.stride()
        assert compare_kv(got, KVDump((0, 1, 2, 3), [layer.contiguous()], 0)).ok


def test_out_of_bounds_strides_are_refused_without_the_loader() -> None:
    # torch.load refuses a view past its storage itself; the check does not rest on that.
    from kvactors.observe.kvdump import _layout_problem

    t = torch.zeros(8, dtype=torch.int32)
    past = types.SimpleNamespace(
        shape=(2, 100),
        stride=lambda: (100, 1),
        numel=lambda: 200,
        storage_offset=lambda: 0,
        untyped_storage=t.untyped_storage,
        element_size=t.element_size,
    )
    assert "out of bounds" in (_layout_problem(past) or "")  # type: ignore[arg-type]
    assert _layout_problem(t.reshape(2, 4)) is None


def test_a_compressed_member_is_refused_before_loading(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.load would inflate a deflated member to its full size: a small file, a large
    # allocation. save_dump never compresses, so a compressed member is refused unread.
    src, bad = tmp_path / "src", tmp_path / "bad"
    torch.save(
        {_M: 1, "block_ids": [0, 1], "block_dim": 0, "layers": [torch.zeros(2, 2**18)]}, str(src)
    )
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as w:
        for m in z.infolist():
            w.writestr(m.filename, z.read(m.filename))
    assert bad.stat().st_size < 2**20 // 50
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("loaded a compressed dump"))
    with pytest.raises(InvalidFileError, match=r"member '.*' is compressed"):
        load_dump(str(bad))


def test_dumps_with_different_block_axes_are_a_mismatch(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same bytes under another block axis is another layout: never IDENTICAL.
    t = torch.arange(16.0).reshape(4, 4)
    for name, bdim in (("b0", 0), ("b1", 1)):
        torch.save(
            {_M: 1, "block_ids": [0, 1, 2, 3], "block_dim": bdim, "layers": [t]},
            str(tmp_path / name),
        )
    report = compare_kv(load_dump(str(tmp_path / "b0")), load_dump(str(tmp_path / "b1")))
    assert not report.ok
    assert report.problems == [
        "block axis differs: stored block_dim 0 vs restored 1 (the blocks are not compared)"
    ]
    assert main(["validate", str(tmp_path / "b0"), str(tmp_path / "b1")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH")
    assert "block axis differs" in out
