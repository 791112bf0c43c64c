"""vLLM-MLU layouts on the path users run: ``Runtime("mlu")`` on the fake torch_mlu.

vLLM-MLU allocates HND ``(2, NB, NH, BS, HS)`` caches while vLLM's legacy layout query answers
"NHD"; LMCache 0.5.6 then sends format 1 with a descriptor read under the NHD reading
(``bs = shape[2]``, ``nh = shape[3]``), which nothing in the shapes can tell from a real NHD
cache. Expected chunks are computed here with plain permutes (token-major
``[2, NL, T, NH*HS]``), independently of kvactors' kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.core.plans import TransferRequest
from kvactors.devices.mlu import MluBackend
from kvactors.devices.mlu.layouts import (
    LAYOUT_SOURCE_ENV,
    layout_source_from_env,
    normalize_mlu_transfer,
)
from kvactors.errors import OperandTypeError, TransferValidationError
from kvactors.runtime import Runtime
from kvactors.testing import FakeVendor, fake_vendor

torch.set_num_threads(1)

NL, NB, HS = 2, 8, 8
IDS = (3, 5, 0, 6)
BPO = 2


def _hnd_chunks(layers: list[torch.Tensor], bs: int, nh: int) -> list[torch.Tensor]:
    """Token-major chunks of HND layers for IDS, BPO blocks per chunk."""
    out = []
    for c in range(len(IDS) // BPO):
        ids = list(IDS[c * BPO : (c + 1) * BPO])
        per_layer = [t[:, ids].permute(0, 1, 3, 2, 4).reshape(2, BPO * bs, nh * HS) for t in layers]
        out.append(torch.stack(per_layer, dim=1))
    return out


def _desc(bs: int, nh: int, **kw: Any) -> ShapeDesc:
    d: dict[str, Any] = {
        "kv_size": 2,
        "nl": NL,
        "nb": NB,
        "bs": bs,
        "nh": nh,
        "hs": HS,
        "element_size": 4,
        "dtype": "float32",
    }
    return ShapeDesc(**(d | kw))


def _req(fmt: int, direction: int, shape: ShapeDesc, chunk: int) -> TransferRequest:
    return TransferRequest(
        fmt=fmt, direction=direction, block_ids=IDS, chunk_size=chunk, shape=shape
    )


@pytest.mark.parametrize(("nh", "bs"), [(4, 4), (2, 4), (4, 2)], ids=["nh==bs", "nh<bs", "nh>bs"])
def test_legacy_nhd_answer_moves_hnd_memory(nh: int, bs: int) -> None:
    """Format 1 + LMCache 0.5.6's NHD-read descriptor, declared legacy: the chunks are the HND
    cache's, byte for byte (as LMCache 0.5.7 would store them), and H2D writes them back."""
    cpu = [torch.randn(2, NB, nh, bs, HS) for _ in range(NL)]
    # Under the NHD reading of (2, NB, nh, bs, HS): bs' = nh, nh' = bs, chunk = BPO * bs'.
    read = _desc(bs=nh, nh=bs)
    chunk = BPO * nh
    with fake_vendor("mlu") as fake, Runtime(MluBackend(layout_source="legacy")) as rt:
        layers = [fake.to_device(t) for t in cpu]
        objs = [torch.zeros(2, NL, chunk, bs * HS) for _ in range(2)]
        rt.transfer(_req(1, 1, read, chunk), layers, objs)
        want = _hnd_chunks(cpu, bs, nh)
        for got, w in zip(objs, want, strict=True):
            assert torch.equal(got.view(w.shape), w)
        dst = [fake.to_device(torch.zeros_like(t)) for t in cpu]
        rt.transfer(_req(1, 0, read, chunk), dst, objs)
        for d, s in zip(dst, cpu, strict=True):
            assert torch.equal(fake.peek(d)[:, list(IDS)], s[:, list(IDS)])


def test_legacy_with_an_hnd_true_descriptor_is_read_as_hnd() -> None:
    cpu = [torch.randn(2, NB, 2, 4, HS) for _ in range(NL)]
    with fake_vendor("mlu") as fake, Runtime(MluBackend(layout_source="legacy")) as rt:
        objs = [torch.zeros(2, NL, BPO * 4, 2 * HS) for _ in range(2)]
        rt.transfer(_req(1, 1, _desc(bs=4, nh=2), BPO * 4), [fake.to_device(t) for t in cpu], objs)
        assert all(torch.equal(g, w) for g, w in zip(objs, _hnd_chunks(cpu, 4, 2), strict=True))


def test_undeclared_nhd_is_refused_before_anything_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAYOUT_SOURCE_ENV, raising=False)
    with fake_vendor("mlu") as fake, Runtime("mlu") as rt:
        layers = [fake.to_device(torch.randn(2, NB, 4, 4, HS)) for _ in range(NL)]
        objs = [torch.full((2, NL, BPO * 4, 4 * HS), 7.0) for _ in range(2)]
        with pytest.raises(TransferValidationError, match=LAYOUT_SOURCE_ENV):
            rt.transfer(_req(1, 1, _desc(4, 4), BPO * 4), layers, objs)
        assert all(bool((o == 7.0).all()) for o in objs)


def test_env_declares_the_source_for_runtime_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin builds ``Runtime("mlu")``: the variable in the worker's environment counts."""
    monkeypatch.setenv(LAYOUT_SOURCE_ENV, "legacy")
    cpu = [torch.randn(2, NB, 4, 2, HS) for _ in range(NL)]
    with fake_vendor("mlu") as fake, Runtime("mlu") as rt:
        objs = [torch.zeros(2, NL, BPO * 4, 2 * HS) for _ in range(2)]
        rt.transfer(_req(1, 1, _desc(bs=4, nh=2), BPO * 4), [fake.to_device(t) for t in cpu], objs)
        want = _hnd_chunks(cpu, 2, 4)
        assert all(torch.equal(g.view(w.shape), w) for g, w in zip(objs, want, strict=True))
    monkeypatch.setenv(LAYOUT_SOURCE_ENV, "hnd")
    with pytest.raises(ValueError, match="legacy"):
        MluBackend()
    assert layout_source_from_env({LAYOUT_SOURCE_ENV: " Resolved "}) == "resolved"


def test_resolved_nhd_is_kept(fake_mlu: FakeVendor) -> None:
    bs, nh = 4, 2
    cpu = [torch.randn(2, NB, bs, nh, HS) for _ in range(NL)]  # real NHD memory
    with Runtime(MluBackend(layout_source="resolved")) as rt:
        objs = [torch.zeros(2, NL, BPO * bs, nh * HS) for _ in range(2)]
        rt.transfer(_req(1, 1, _desc(bs, nh), BPO * bs), [fake_mlu.to_device(t) for t in cpu], objs)
        # NHD memory seen through HND eyes: transpose heads and slots back.
        want = _hnd_chunks([t.transpose(2, 3) for t in cpu], bs, nh)
        assert all(torch.equal(g, w) for g, w in zip(objs, want, strict=True))


def test_cache_scale_index_lists_are_unwrapped(fake_mlu: FakeVendor) -> None:
    cpu = [torch.randn(2, NB, 2, 4, HS) for _ in range(NL)]
    entries = [[fake_mlu.to_device(t), torch.empty(0), torch.empty(0)] for t in cpu]
    with Runtime("mlu") as rt:
        objs = [torch.zeros(2, NL, BPO * 4, 2 * HS) for _ in range(2)]
        rt.transfer(_req(6, 1, _desc(4, 2), BPO * 4), entries, objs)
        assert all(torch.equal(g, w) for g, w in zip(objs, _hnd_chunks(cpu, 4, 2), strict=True))


@pytest.mark.parametrize(
    ("extra", "exc", "match"),
    [
        ({"scale": torch.ones(2, NB, 2, 4)}, TransferValidationError, "scale"),
        ({"index": torch.ones(NB, 1, 4, 16)}, TransferValidationError, "index_cache"),
        ({"bad": "x"}, OperandTypeError, r"\[cache, scale, index_cache\]"),
    ],
    ids=["int8-scales", "indexer", "not-tensors"],
)
def test_entries_that_would_lose_data_are_refused(
    fake_mlu: FakeVendor, extra: dict[str, Any], exc: type[Exception], match: str
) -> None:
    cache = fake_mlu.to_device(torch.randn(2, NB, 2, 4, HS))
    scale = extra.get("scale", torch.empty(0))
    index = extra.get("index", torch.empty(0))
    entry: list[Any] = [cache, scale, index] if "bad" not in extra else [cache, "x"]
    objs = [torch.full((2, NL, BPO * 4, 2 * HS), 7.0) for _ in range(2)]
    with Runtime("mlu") as rt, pytest.raises(exc, match=match):
        rt.transfer(_req(6, 1, _desc(4, 2), BPO * 4), [entry] * NL, objs)
    assert all(bool((o == 7.0).all()) for o in objs)


@pytest.mark.parametrize("padded", [False, True])
def test_five_d_mla_caches_are_squeezed(fake_mlu: FakeVendor, padded: bool) -> None:
    bs, hs = 4, 8
    width = hs + 2 if padded else hs
    cpu = [torch.randn(1, NB, 1, bs, width) for _ in range(NL)]
    layers = [fake_mlu.to_device(t)[..., :hs] for t in cpu]
    desc = ShapeDesc(kv_size=1, nl=NL, nb=NB, bs=bs, nh=1, hs=hs, element_size=4, dtype="float32")
    with Runtime("mlu") as rt:
        objs = [torch.zeros(NL, BPO * bs, hs) for _ in range(2)]
        rt.transfer(_req(3, 1, desc, BPO * bs), layers, objs)
        for c, got in enumerate(objs):
            ids = list(IDS[c * BPO : (c + 1) * BPO])
            want = torch.stack([t[0, ids, 0, :, :hs].reshape(BPO * bs, hs) for t in cpu])
            assert torch.equal(got, want)


def test_formats_outside_the_mlu_set_are_refused(fake_mlu: FakeVendor) -> None:
    k = [fake_mlu.to_device(torch.randn(NB, 4, 2, HS)) for _ in range(NL)]
    with Runtime("mlu") as rt, pytest.raises(TransferValidationError, match="MLU transfers take"):
        rt.transfer(
            _req(int(KVFormat.TWO_X_NL_X_NB_BS_NH_HS), 1, _desc(4, 2), BPO * 4),
            [k, list(k)],
            [torch.zeros(2, NL, BPO * 4, 2 * HS)] * 2,
        )


class _Counted(torch.Tensor):
    """A subclass answering torch calls in Python (as a device's fake tensors do), counted."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _Counted.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def test_an_mla_request_reads_its_layers_shapes_without_torch_function() -> None:
    """An MLA request's layers are checked for vLLM-MLU's 5-D shape by metadata alone: no
    ``__torch_function__`` of theirs runs per layer (a per-layer cost LMCache's MLA op, one
    tensor a layer, does not have), and 3-D layers pass through as they are."""
    desc = ShapeDesc(kv_size=1, nl=NL, nb=NB, bs=4, nh=1, hs=HS, element_size=4, dtype="float32")
    layers = [torch.randn(NB, 4, HS).as_subclass(_Counted) for _ in range(NL)]
    objs = [torch.zeros(NL, BPO * 4, HS)]
    _Counted.calls = 0
    fmt, shape, chunk, got, got_objs = normalize_mlu_transfer(
        int(KVFormat.NL_X_NB_BS_HS), desc, BPO * 4, layers, objs, "resolved"
    )
    assert _Counted.calls == 0
    assert (fmt, shape, chunk, got_objs) == (KVFormat.NL_X_NB_BS_HS, desc, BPO * 4, objs)
    assert all(a is b for a, b in zip(got, layers, strict=True))
