"""KV-cache layouts kvactors can move: formats, directions, shape descriptors (pure data).

Formats keep LMCache's ``EngineKVFormat`` numbers and are described by data (:data:`FORMAT_SPECS`):
the paged structure, the axis letters of one paged tensor (``L`` layer, ``P`` K/V plane, ``B``
block, ``S`` slot, ``H`` head, ``D`` element) and the token-major host chunk shape. Paged
element ``(l, p, b, s, h, d)`` maps to chunk element ``(p, l, j*BS + s, h, d)``, ``j`` the
block's slot. Other formats are rejected. No torch, no asyncio.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = (
    "DTYPE_ITEMSIZE",
    "FORMAT_SPECS",
    "Direction",
    "FormatSpec",
    "KVFormat",
    "PagedKind",
    "ShapeDesc",
    "format_spec",
)


class KVFormat(enum.IntEnum):
    """Supported engine KV formats; values equal LMCache's ``EngineKVFormat`` numbers."""

    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10
    NL_X_NB_BS_NH_TWO_HS = 11
    NL_X_NB_NH_BS_CS = 12
    NL_X_NB_BS_NH_CS = 13
    NL_X_TWO_X_NB_BS_NH_HS = 16
    NL_X_NB_BS_NH_HS = 18


class Direction(enum.IntEnum):
    """Transfer direction; values equal LMCache's ``TransferDirection``."""

    H2D = 0
    """Host chunk -> paged memory ("scatter", LMCache retrieve)."""
    D2H = 1
    """Paged memory -> host chunk ("gather", LMCache store)."""


class PagedKind(enum.Enum):
    """How the paged operand is structured."""

    CROSS_LAYER = "cross_layer"
    """One tensor holding every layer."""
    LAYER_LIST = "layer_list"
    """A sequence with one tensor per layer."""
    KV_LIST = "kv_list"
    """``[[K_0..K_{NL-1}], [V_0..V_{NL-1}]]`` (a flat ``[K..., V...]`` is accepted too)."""
    KV_PAIRS = "kv_pairs"
    """``[(K_0, V_0), ..., (K_{NL-1}, V_{NL-1})]``: one K/V pair per layer."""


class FormatSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The facts kvactors needs about one format.

    Attributes:
        fmt: The format.
        kind: The structure of the paged operand.
        axes: Axis letters of one paged tensor (see the module docstring).
        is_mla: One plane, one head; objects are ``[NL, T, HS]`` and ``kv_size`` is 1.
        is_hnd: Head-major blocks (``... H, S, D``): moving them transposes to token-major.
        allows_block_padding: ``ShapeDesc.block_stride_elems`` may be non-zero (dim-0 padding).
        single_plane: One plane of ``NH`` heads per tensor: fused K/V, whose ``D`` axis packs
            K then V (``hs`` is the packed width ``2*head_size``), or one independent
            component per tensor (format 18, whose ``nl`` counts components). Objects are
            ``[NL, T, NH*HS]`` and ``kv_size`` is 1. A paged tensor may also carry ``D`` as
            two trailing axes ``[2, D/2]``, merged with a view (LMCache's torch path takes
            both forms).
    """

    fmt: KVFormat
    kind: PagedKind
    axes: tuple[str, ...]
    is_mla: bool = False
    is_hnd: bool = False
    allows_block_padding: bool = False
    single_plane: bool = False

    @property
    def is_kv_list(self) -> bool:
        """Whether K and V are separate tensors (two lists, or one pair per layer)."""
        return self.kind is PagedKind.KV_LIST or self.kind is PagedKind.KV_PAIRS

    @property
    def planes(self) -> int:
        """Number of K/V planes (``kv_size``): 1 for MLA and fused K/V, else 2."""
        return 1 if self.is_mla or self.single_plane else 2

    def tensor_shape(self, nl: int, nb: int, bs: int, nh: int, hs: int) -> tuple[int, ...]:
        """The shape one paged tensor of this format must have."""
        sizes = {"L": nl, "P": self.planes, "B": nb, "S": bs, "H": nh, "D": hs}
        return tuple(sizes[a] for a in self.axes)

    def object_shape(self, nl: int, tokens: int, nh: int, hs: int) -> tuple[int, ...]:
        """The shape of one host chunk holding ``tokens`` token rows."""
        if self.planes == 1:
            return (nl, tokens, nh * hs)
        return (2, nl, tokens, nh * hs)


FORMAT_SPECS: dict[KVFormat, FormatSpec] = {
    KVFormat.NB_NL_TWO_BS_NH_HS: FormatSpec(
        fmt=KVFormat.NB_NL_TWO_BS_NH_HS,
        kind=PagedKind.CROSS_LAYER,
        axes=("B", "L", "P", "S", "H", "D"),
    ),
    KVFormat.NL_X_TWO_NB_BS_NH_HS: FormatSpec(
        fmt=KVFormat.NL_X_TWO_NB_BS_NH_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("P", "B", "S", "H", "D"),
    ),
    KVFormat.NL_X_NB_TWO_BS_NH_HS: FormatSpec(
        fmt=KVFormat.NL_X_NB_TWO_BS_NH_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "P", "S", "H", "D"),
    ),
    KVFormat.NL_X_NB_BS_HS: FormatSpec(
        fmt=KVFormat.NL_X_NB_BS_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "S", "D"),
        is_mla=True,
        allows_block_padding=True,
    ),
    KVFormat.NL_X_TWO_NB_NH_BS_HS: FormatSpec(
        fmt=KVFormat.NL_X_TWO_NB_NH_BS_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("P", "B", "H", "S", "D"),
        is_hnd=True,
    ),
    KVFormat.NL_X_NB_TWO_NH_BS_HS: FormatSpec(
        fmt=KVFormat.NL_X_NB_TWO_NH_BS_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "P", "H", "S", "D"),
        is_hnd=True,
    ),
    KVFormat.NB_NL_TWO_NH_BS_HS: FormatSpec(  # TRT-LLM's cross-layer pool
        fmt=KVFormat.NB_NL_TWO_NH_BS_HS,
        kind=PagedKind.CROSS_LAYER,
        axes=("B", "L", "P", "H", "S", "D"),
        is_hnd=True,
    ),
    KVFormat.TWO_X_NL_X_NB_BS_NH_HS: FormatSpec(
        fmt=KVFormat.TWO_X_NL_X_NB_BS_NH_HS,
        kind=PagedKind.KV_LIST,
        axes=("B", "S", "H", "D"),
    ),
    # vLLM's blocks-first fused K/V layouts: 12 is its CPU attention's [NB, NH, BS, 2*HS];
    # 10 and 11 are the same memory with the K/V axis split off (LMCache deprecated them in
    # favour of 12 and 13 and takes either tensor form for all four).
    KVFormat.NL_X_NB_NH_BS_TWO_HS: FormatSpec(
        fmt=KVFormat.NL_X_NB_NH_BS_TWO_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "H", "S", "D"),
        is_hnd=True,
        single_plane=True,
    ),
    KVFormat.NL_X_NB_BS_NH_TWO_HS: FormatSpec(
        fmt=KVFormat.NL_X_NB_BS_NH_TWO_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "S", "H", "D"),
        single_plane=True,
    ),
    KVFormat.NL_X_NB_NH_BS_CS: FormatSpec(
        fmt=KVFormat.NL_X_NB_NH_BS_CS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "H", "S", "D"),
        is_hnd=True,
        allows_block_padding=True,
        single_plane=True,
    ),
    KVFormat.NL_X_NB_BS_NH_CS: FormatSpec(
        fmt=KVFormat.NL_X_NB_BS_NH_CS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "S", "H", "D"),
        allows_block_padding=True,
        single_plane=True,
    ),
    KVFormat.NL_X_TWO_X_NB_BS_NH_HS: FormatSpec(  # vLLM-Ascend's per-layer (K, V) tuples
        fmt=KVFormat.NL_X_TWO_X_NB_BS_NH_HS,
        kind=PagedKind.KV_PAIRS,
        axes=("B", "S", "H", "D"),
    ),
    KVFormat.NL_X_NB_BS_NH_HS: FormatSpec(  # SGLang's independent components
        fmt=KVFormat.NL_X_NB_BS_NH_HS,
        kind=PagedKind.LAYER_LIST,
        axes=("B", "S", "H", "D"),
        allows_block_padding=True,
        single_plane=True,
    ),
}
"""Every supported format, keyed by format."""


def format_spec(fmt: int) -> FormatSpec | None:
    """The spec of format number ``fmt``, or ``None`` when kvactors does not support it."""
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        return None
    try:
        return FORMAT_SPECS[KVFormat(fmt)]
    except ValueError:
        return None


DTYPE_ITEMSIZE: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "float32": 4,
    "int32": 4,
    "float64": 8,
    "int64": 8,
}
"""KV dtypes kvactors accepts, by torch name, with their size in bytes."""


class ShapeDesc(msgspec.Struct, frozen=True, kw_only=True):
    """kvactors' copy of LMCache's ``PageBufferShapeDesc`` (wire-safe).

    Attributes:
        kv_size: Object planes: 2 for split K/V, 1 for MLA and fused K/V.
        nl: Layers (per K/V list for format 9; components for format 18).
        nb: Blocks in each paged tensor.
        bs: Token slots per block.
        nh: KV heads (1 for MLA).
        hs: Head size (MLA: latent width; fused K/V: the packed width ``2*head_size``).
        element_size: Bytes per element.
        block_stride_elems: Physical stride of the block axis in elements; 0 = take it from the
            tensors. Non-zero only for formats that allow block padding (3, 12, 13, 18).
        dtype: Exact torch dtype name (``"bfloat16"``); authoritative when set. ``None`` means
            "take it from the tensors" (a 2-byte size alone is ambiguous and never guessed).
    """

    kv_size: int
    nl: int
    nb: int
    bs: int
    nh: int
    hs: int
    element_size: int
    block_stride_elems: int = 0
    dtype: str | None = None
