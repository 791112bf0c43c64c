"""vLLM-MLU KV-cache layouts: what an MLU transfer request means (pure: metadata only).

vLLM-MLU's MHA caches are HND ``(2, NB, NH, BS, HS)`` while its legacy layout query answers
"NHD", so format 1 on MLU is ambiguous: :func:`normalize_mlu_transfer` refuses it unless the
source was declared (:data:`LAYOUT_SOURCE_ENV` or ``MluBackend(layout_source=...)``):
``"legacy"`` rewrites it to format 6 as LMCache 0.5.7 does, ``"resolved"`` keeps it. Layer
entries ``[cache, scale, index_cache]`` are unwrapped (non-empty scale or indexer caches are
refused), MLA caches squeezed to ``(NB, BS, HS)``; other formats are refused as LMCache's own
MLU ops refuse them.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvactors.core.layouts import KVFormat, ShapeDesc
from kvactors.errors import InvalidSettingError, OperandTypeError, TransferValidationError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = (
    "LAYOUT_SOURCE_ENV",
    "MLU_FORMATS",
    "LayoutSource",
    "layout_source_from_env",
    "normalize_mlu_transfer",
    "squeeze_mla",
    "unwrap_layer",
)

LayoutSource = Literal["legacy", "resolved"]
"""Where an MLU request's format came from: vLLM's legacy layout query (``"legacy"``: HND
memory whatever it says) or a layout the engine resolved explicitly (``"resolved"``)."""

LAYOUT_SOURCE_ENV = "KVACTORS_MLU_LAYOUT_SOURCE"
"""Environment variable declaring the :data:`LayoutSource` (``legacy`` or ``resolved``)."""

MLU_FORMATS = frozenset(
    {KVFormat.NL_X_TWO_NB_BS_NH_HS, KVFormat.NL_X_TWO_NB_NH_BS_HS, KVFormat.NL_X_NB_BS_HS}
)
"""Formats an MLU transfer accepts (LMCache's MLU ops' set)."""

_SOURCES: tuple[LayoutSource, ...] = ("legacy", "resolved")


def layout_source_from_env(env: Mapping[str, str]) -> LayoutSource | None:
    """The declared layout source in ``env`` (None when unset).

    Raises:
        ValueError: a value other than ``legacy``/``resolved``.
    """
    raw = env.get(LAYOUT_SOURCE_ENV, "").strip().lower()
    if not raw:
        return None
    for s in _SOURCES:
        if raw == s:
            return s
    raise InvalidSettingError(
        f"{LAYOUT_SOURCE_ENV}={raw!r}: expected 'legacy' or 'resolved'", setting=LAYOUT_SOURCE_ENV
    )


def squeeze_mla(t: torch.Tensor) -> torch.Tensor:
    """``(1, NB, 1, BS, HS)`` -> the ``(NB, BS, HS)`` view; other shapes pass through."""
    if t.dim() == 5 and t.shape[0] == 1 and t.shape[2] == 1:
        return t[0, :, 0]
    return t


_SHAPE = operator.attrgetter("shape")
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_MLA_VIEW = operator.itemgetter((0, slice(None), 0))  # squeeze_mla's view, in C


def unwrap_layer(value: object, layer: int) -> object:
    """One layer's cache from vLLM-MLU's ``[cache, scale, index_cache]`` entry.

    A tensor (or anything else) passes through for the planner to check.

    Raises:
        OperandTypeError: a list whose entries are not tensors.
        TransferValidationError: a non-empty scale or indexer cache (it would be lost).
    """
    if not isinstance(value, (list, tuple)):
        return value
    if not value or not all(isinstance(x, torch.Tensor) for x in value):
        raise OperandTypeError(
            f"MLU layer {layer}: a vLLM-MLU layer entry must be [cache, scale, index_cache] "
            "tensors",
            field="paged",
        )
    cache, *rest = value
    for name, extra in zip(("scale", "index_cache"), rest, strict=False):
        if extra.numel() > 0:
            raise TransferValidationError(
                f"MLU layer {layer}: non-empty {name} {tuple(extra.shape)}; kvactors moves the "
                f"KV cache only, so the {name} would be lost (int8 KV scales and the DeepSeek "
                "indexer cache are not supported)",
                field="paged",
            )
    if len(rest) > 2:
        raise OperandTypeError(
            f"MLU layer {layer}: expected [cache, scale, index_cache], got {len(value)} entries",
            field="paged",
        )
    return cache


def normalize_mlu_transfer(
    fmt: int,
    shape: ShapeDesc,
    chunk_size: int,
    paged: Any,
    objects: Sequence[torch.Tensor],
    source: LayoutSource | None,
) -> tuple[KVFormat, ShapeDesc, int, Any, Sequence[torch.Tensor]]:
    """The MLU request kvactors plans: format, descriptor, chunk size, layers, host chunks.

    Reads metadata only; views are made, nothing is copied.

    Raises:
        TransferValidationError: a format MLU does not take, format 1 without a declared
            layout source, a legacy request whose descriptor matches neither reading, or a
            layer entry that would lose data.
        OperandTypeError: a malformed layer entry.
    """
    if isinstance(fmt, bool) or fmt not in MLU_FORMATS:
        names = ", ".join(f"{f.name} ({int(f)})" for f in sorted(MLU_FORMATS))
        raise TransferValidationError(
            f"MLU transfers take only {names}; got format {fmt!r}", field="fmt"
        )
    f = KVFormat(fmt)
    if not isinstance(paged, (list, tuple)):
        return f, shape, chunk_size, paged, objects  # the planner names the structure error
    kinds = set(map(type, paged))
    tensors = len(kinds) == 1 and issubclass(next(iter(kinds)), torch.Tensor)
    if tensors:
        layers: Any = list(paged)  # tensors only (the engine's common case): nothing to unwrap
    else:
        layers = [unwrap_layer(v, i) for i, v in enumerate(paged)]
    if f is KVFormat.NL_X_NB_BS_HS:
        if tensors:  # metadata only: no subclass's __torch_function__ runs per layer
            with _NO_TORCH_FUNCTION():
                shapes: set[Any] | tuple[()] = set(map(_SHAPE, layers))
        else:
            shapes = ()
        if len(shapes) == 1:  # every layer of one shape: squeeze_mla's answer is the same
            s = next(iter(shapes))
            if len(s) == 5 and s[0] == 1 and s[2] == 1:  # squeeze_mla's test, on the shape
                layers = list(map(_MLA_VIEW, layers))
        else:
            layers = [squeeze_mla(t) if isinstance(t, torch.Tensor) else t for t in layers]
        return f, shape, chunk_size, layers, objects
    if f is KVFormat.NL_X_TWO_NB_NH_BS_HS:
        return f, shape, chunk_size, layers, objects
    if source is None:
        raise TransferValidationError(
            "format NL_X_TWO_NB_BS_NH_HS (NHD) on MLU is ambiguous: vLLM-MLU allocates HND "
            "(2, NB, NH, BS, HS) caches and its legacy layout query still answers 'NHD', and "
            "the shapes cannot tell the two apart. Declare where the format came from: "
            f"{LAYOUT_SOURCE_ENV}=legacy (LMCache 0.5.6 with vLLM-MLU: the memory is HND) or "
            f"{LAYOUT_SOURCE_ENV}=resolved (the engine resolved NHD explicitly), or "
            "MluBackend(layout_source=...)",
            field="fmt",
        )
    if source == "resolved":
        return f, shape, chunk_size, layers, objects
    return _legacy_as_hnd(shape, chunk_size, layers, objects)


def _legacy_as_hnd(
    shape: ShapeDesc, chunk_size: int, layers: list[Any], objects: Sequence[torch.Tensor]
) -> tuple[KVFormat, ShapeDesc, int, Any, Sequence[torch.Tensor]]:
    hnd = KVFormat.NL_X_TWO_NB_NH_BS_HS
    first = layers[0] if layers else None
    if not isinstance(first, torch.Tensor) or first.dim() != 5:
        return hnd, shape, chunk_size, layers, objects  # the planner names the shape error
    nh, bs = int(first.shape[2]), int(first.shape[3])
    if (shape.bs, shape.nh) == (bs, nh):
        return hnd, shape, chunk_size, layers, objects  # descriptor already HND-true
    if (shape.bs, shape.nh) != (nh, bs):
        raise TransferValidationError(
            f"legacy MLU request: descriptor bs={shape.bs}, nh={shape.nh} matches neither "
            f"reading of the cache {tuple(first.shape)} (HND: bs={bs}, nh={nh})",
            field="shape",
        )
    if shape.bs <= 0 or chunk_size % shape.bs:
        raise TransferValidationError(
            f"chunk size {chunk_size} is not a whole number of {shape.bs}-slot blocks",
            field="chunk_size",
        )
    per_chunk = chunk_size // shape.bs
    new_chunk = per_chunk * bs
    new_shape = ShapeDesc(
        kv_size=shape.kv_size,
        nl=shape.nl,
        nb=shape.nb,
        bs=bs,
        nh=nh,
        hs=shape.hs,
        element_size=shape.element_size,
        block_stride_elems=shape.block_stride_elems,
        dtype=shape.dtype,
    )
    old_obj = (2, shape.nl, chunk_size, shape.nh * shape.hs)
    new_obj = (2, shape.nl, new_chunk, nh * shape.hs)
    objs = [
        o.view(new_obj)
        if isinstance(o, torch.Tensor) and tuple(o.shape) == old_obj and o.is_contiguous()
        else o
        for o in objects
    ]
    return hnd, new_shape, new_chunk, layers, objs
