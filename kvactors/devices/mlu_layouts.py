"""vLLM-MLU KV-cache layout facts (pure: reads shapes and dtypes, never device state).

Theory of operation. vLLM-MLU allocates MHA caches as ``(2, NB, NH, BS, HS)``: physically
and logically HND, contiguous, with no stride order. vLLM's layout query is never told and
answers "NHD", so a legacy or missing layout answer is normalised to HND for MLU; a layout
the engine resolved explicitly (newer vLLM's resolved cache layout) is kept. Shape alone
cannot tell ``[2,NB,NH,BS,HS]`` from ``[2,NB,BS,NH,HS]``, so the hint decides, and a wrong
hint would silently swap block size and heads; that is why the normalisation lives here,
in one tested place.

Each layer's entry in vLLM-MLU's ``kv_caches`` is the list ``[cache, scale, index_cache]``;
scale and index are empty unless int8 KV (scales ``(2, NB, NH, BS)`` float32) or the
DeepSeek-v3.2 indexer is on. The cache is unwrapped; int8 KV with scales is refused unless
the caller moves the scales too. MLA caches ``(1, NB, 1, BS, HS)`` are squeezed to
``(NB, BS, HS)`` (a view; padded block strides survive).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from kvactors.errors import OperandTypeError, TransferValidationError
from kvactors.layouts import KVFormat

__all__ = (
    "LayoutSource",
    "MluKvLayer",
    "MluLayout",
    "classify_layer",
    "normalize_layout_hint",
    "squeeze_mla",
    "unwrap_layer",
)

LayoutSource = Literal["legacy", "resolved"]
"""Where a layout answer came from: vLLM's ``get_kv_cache_layout()`` (or nothing) is
``"legacy"``; the engine's resolved cache layout is ``"resolved"``."""

_RESOLVED = {"NHD": "NHD", "HND": "HND", "LBNHC": "NHD", "LBHNC": "HND"}
_INT8 = (torch.int8, torch.uint8)


class MluLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A classified per-layer MLU cache."""

    fmt: KVFormat
    kv_layout: str
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int


class MluKvLayer(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """One unwrapped layer: the cache tensor and, when moved too, its int8 scales."""

    cache: torch.Tensor
    scale: torch.Tensor | None = None


def normalize_layout_hint(hint: str | None, source: LayoutSource = "legacy") -> str:
    """The physical layout of an MLU MHA cache.

    Args:
        hint: The layout answer (``"NHD"``, ``"HND"``, ``"LBNHC"``, ``"LBHNC"``) or None.
        source: ``"legacy"`` for vLLM's ``get_kv_cache_layout()`` or a missing answer (always
            HND on MLU, whatever it says); ``"resolved"`` for an explicitly resolved layout.

    Raises:
        TransferValidationError: a resolved layout kvactors cannot name.
    """
    if source == "legacy":
        return "HND"
    if hint is None or hint.upper() not in _RESOLVED:
        raise TransferValidationError(
            f"unsupported resolved MLU KV layout {hint!r}; expected one of "
            f"{', '.join(sorted(_RESOLVED))}", field="kv_layout",
        )
    return _RESOLVED[hint.upper()]


def squeeze_mla(t: torch.Tensor) -> torch.Tensor:
    """``(1, NB, 1, BS, HS)`` -> ``(NB, BS, HS)`` view; 3-D caches pass through."""
    if t.dim() == 3:
        return t
    if t.dim() == 5 and t.shape[0] == 1 and t.shape[2] == 1:
        return t[0, :, 0]
    raise TransferValidationError(
        f"not an MLU MLA cache: shape {tuple(t.shape)} (expected (1, NB, 1, BS, HS))",
        field="paged",
    )


def unwrap_layer(value: object, *, move_scales: bool = False) -> MluKvLayer:
    """One layer's cache from vLLM-MLU's ``[cache, scale, index_cache]`` entry (or a tensor).

    Raises:
        OperandTypeError: neither a tensor nor a list/tuple starting with one.
        TransferValidationError: int8 KV with scales while ``move_scales`` is False.
    """
    if isinstance(value, torch.Tensor):
        return MluKvLayer(cache=value)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise OperandTypeError(
            f"an MLU layer must be a tensor or [cache, scale, index], got {type(value).__name__}",
            field="paged",
        )
    cache, *rest = value
    if not isinstance(cache, torch.Tensor) or not all(isinstance(x, torch.Tensor) for x in rest):
        raise OperandTypeError("an MLU layer list must hold tensors", field="paged")
    scale = rest[0] if rest and rest[0].numel() > 0 else None
    if scale is not None and cache.dtype in _INT8 and not move_scales:
        raise TransferValidationError(
            "int8 MLU KV cache with scales: moving the cache without its scales would lose "
            "them; move the scales too (move_scales=True) or disable kv8", field="paged",
        )
    return MluKvLayer(cache=cache, scale=scale if move_scales else None)


def classify_layer(
    t: torch.Tensor, hint: str | None = None, source: LayoutSource = "legacy"
) -> tuple[torch.Tensor, MluLayout]:
    """Normalise one (unwrapped) layer and name its layout.

    MHA ``[2, NB, X, Y, HS]`` is read as HND unless an explicitly resolved hint says NHD; MLA
    ``(1, NB, 1, BS, HS)`` (or ``[NB, BS, HS]``) is squeezed.

    Returns:
        The (possibly squeezed) tensor and its layout.

    Raises:
        TransferValidationError: a shape that is neither.
    """
    shape = tuple(t.shape)
    if (len(shape) == 5 and shape[0] == 1 and shape[2] == 1) or len(shape) == 3:
        v = squeeze_mla(t)
        nb, bs, hs = v.shape
        return v, MluLayout(fmt=KVFormat.NL_X_NB_BS_HS, kv_layout="MLA", num_blocks=nb,
                            block_size=bs, num_heads=1, head_size=hs)
    if len(shape) == 5 and shape[0] == 2:
        layout = normalize_layout_hint(hint, source)
        _, nb, a, b, hs = shape
        if layout == "HND":
            return t, MluLayout(fmt=KVFormat.NL_X_TWO_NB_NH_BS_HS, kv_layout="HND",
                                num_blocks=nb, block_size=b, num_heads=a, head_size=hs)
        return t, MluLayout(fmt=KVFormat.NL_X_TWO_NB_BS_NH_HS, kv_layout="NHD", num_blocks=nb,
                            block_size=a, num_heads=b, head_size=hs)
    raise TransferValidationError(
        f"unrecognised MLU KV cache shape {shape}: expected (2, NB, NH, BS, HS) or "
        "(1, NB, 1, BS, HS)", field="paged",
    )
