"""KV bit-equality: compare stored and restored KV blocks exactly, per layer and per block.

The first step of the serving validation method (``docs/validation.md``): before looking at
generated tokens or log-probabilities, prove that the KV an engine restored from the cache is
bit-identical to the KV it stored. Take a :class:`KVDump` of the blocks right after the
prefill that stored them (:func:`dump_paged`, :func:`save_dump`), another of the blocks the
cache restored into (possibly other block ids, in the same chunk order), and compare::

    kvactors validate stored.kvdump restored.kvdump

Elements are compared as raw bits (a NaN equals the same NaN; ``-0.0`` differs from ``0.0``):
any difference is a transfer bug, never "numerical noise".
"""

from __future__ import annotations

import dataclasses
import zipfile
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec
import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat, PagedKind
from kvactors.errors import InvalidFileError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = (
    "BlockMismatch",
    "KVDump",
    "ValidationReport",
    "compare_kv",
    "dump_paged",
    "format_report",
    "load_dump",
    "save_dump",
)

_MAGIC = "kvactors_kv_dump"
_KEYS = frozenset({_MAGIC, "block_ids", "block_dim", "layers"})
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class KVDump:
    """KV blocks of every layer, on the host.

    Attributes:
        block_ids: The engine block ids, in chunk order (position ``i`` along ``block_dim``).
        layers: One tensor per layer holding those blocks along ``block_dim``.
        block_dim: The block axis of every layer tensor.
    """

    block_ids: tuple[int, ...]
    layers: list[torch.Tensor]
    block_dim: int


class BlockMismatch(msgspec.Struct, frozen=True, kw_only=True):
    """One (layer, block position) whose bits differ."""

    layer: int
    position: int
    stored_block: int
    restored_block: int
    elements: int
    total: int
    first_index: int


class ValidationReport(msgspec.Struct, frozen=True, kw_only=True):
    """The result of :func:`compare_kv`; ``ok`` only when every bit matched."""

    ok: bool
    layers: int
    blocks: int
    elements: int
    mismatched_blocks: int
    mismatched_elements: int
    problems: list[str]
    mismatches: list[BlockMismatch]


def dump_paged(paged: Any, fmt: int, block_ids: Sequence[int]) -> KVDump:
    """Copy ``block_ids`` of engine paged memory in layout ``fmt`` to the host.

    Args:
        paged: The engine's paged KV structure, as passed to a transfer (a tensor per layer,
            one cross-layer tensor, or ``[K list, V list]``), on any device.
        fmt: A :class:`~kvactors.core.layouts.KVFormat` number.
        block_ids: The blocks to take, in chunk order.

    Returns:
        The dump; each block is read with a host read of a plain view (works on every device).
    """
    spec = FORMAT_SPECS[KVFormat(fmt)]
    ids = [int(b) for b in block_ids]

    def take(t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.stack([t.select(dim, b).cpu() for b in ids], dim=dim)

    if spec.kind is PagedKind.CROSS_LAYER:
        bdim, ldim = spec.axes.index("B"), spec.axes.index("L")
        whole = take(paged, bdim)
        layers = list(whole.unbind(ldim))
        return KVDump(tuple(ids), layers, bdim if bdim < ldim else bdim - 1)
    if spec.is_kv_list:
        ks: Sequence[torch.Tensor]
        vs: Sequence[torch.Tensor]
        if spec.kind is PagedKind.KV_PAIRS:
            ks, vs = [kv[0] for kv in paged], [kv[1] for kv in paged]
        else:
            ks, vs = (paged[0], paged[1]) if len(paged) == 2 else _halves(paged)
        bdim = spec.axes.index("B")
        layers = [torch.stack([take(k, bdim), take(v, bdim)]) for k, v in zip(ks, vs, strict=True)]
        return KVDump(tuple(ids), layers, bdim + 1)
    bdim = spec.axes.index("B")
    return KVDump(tuple(ids), [take(t, bdim) for t in paged], bdim)


def _halves(flat: Sequence[torch.Tensor]) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    n = len(flat) // 2
    return flat[:n], flat[n:]


def save_dump(dump: KVDump, path: str) -> None:
    """Write ``dump`` to ``path`` (a ``torch.save`` file loadable with ``weights_only``)."""
    torch.save(
        {
            _MAGIC: 1,
            "block_ids": list(dump.block_ids),
            "block_dim": dump.block_dim,
            "layers": [t.contiguous() for t in dump.layers],
        },
        path,
    )


def load_dump(path: str) -> KVDump:
    """Read a dump written by :func:`save_dump`, checking its structure before any comparison.

    Before loading, the file must be torch's zip format with stored (uncompressed) members,
    so loading allocates no more than the file holds. It is loaded
    with ``weights_only=True`` (no pickled code runs), then checked: exactly the keys
    :func:`save_dump` writes, ``block_ids`` a list of ints, ``layers`` a non-empty list of
    dense tensors of a fixed-size dtype, ``block_dim`` an axis of every layer whose length is
    the number of block ids, and strides that neither repeat (stride 0), overlap nor reach
    past the layer's storage, so that no comparison materialises more than the file holds.

    Raises:
        InvalidFileError: the file is unreadable as a dump, or not a well-formed kvactors KV
            dump (a ValueError).
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:  # an unreadable path is an OSError; all else is the content
        _check_archive(path, f)
        try:
            data = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling, EOF, a damaged zip: "not a dump we can read"
            raise _unreadable(path, exc) from exc

    def bad(what: str) -> InvalidFileError:
        return InvalidFileError(f"{path}: malformed kvactors KV dump: {what}", path=path)

    if not isinstance(data, dict) or data.get(_MAGIC) != 1:
        raise InvalidFileError(
            f"{path}: not a kvactors KV dump (written by kvactors.observe.kvdump.save_dump)",
            path=path,
        )
    keys = set(data)
    if keys != _KEYS:
        missing, extra = sorted(map(str, _KEYS - keys)), sorted(map(str, keys - _KEYS))
        raise bad(f"keys missing {missing}, unexpected {extra}")
    ids, layers, bdim = data["block_ids"], data["layers"], data["block_dim"]
    if not isinstance(ids, list) or not all(_is_int(b) for b in ids):
        raise bad("block_ids must be a list of ints")
    if not _is_int(bdim):
        raise bad(f"block_dim must be an int, got {type(bdim).__name__}")
    if not isinstance(layers, list) or not layers:
        raise bad("layers must be a non-empty list of tensors")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise bad(f"layer {i} is not a dense tensor ({type(t).__name__})")
        if t.element_size() not in _BITS:
            raise bad(f"layer {i} has dtype {t.dtype}, whose elements cannot be compared as bits")
        if not 0 <= bdim < t.dim():
            raise bad(f"block_dim {bdim} is not an axis of layer {i} (shape {list(t.shape)})")
        if t.shape[bdim] != len(ids):
            raise bad(
                f"layer {i} holds {t.shape[bdim]} blocks along block_dim {bdim}, "
                f"but there are {len(ids)} block ids"
            )
        if (problem := _layout_problem(t)) is not None:
            raise bad(f"layer {i} (shape {list(t.shape)}, stride {list(t.stride())}) {problem}")
    return KVDump(tuple(int(b) for b in ids), list(layers), int(bdim))


def _check_archive(path: str, f: BinaryIO) -> None:
    """The file is torch's zip format with every member stored, not compressed.

    ``torch.load`` allocates each storage at its uncompressed size, so a deflated member could
    make a small file allocate without bound; :func:`save_dump` (``torch.save``) never
    compresses. With stored members, what loading allocates is bounded by the file's size
    (a member whose header claims more than the file holds fails to read).
    """
    try:
        with zipfile.ZipFile(f) as z:
            members = z.infolist()
    except Exception as exc:  # not a zip, or a damaged one: "not a dump we can read"
        raise _unreadable(path, exc) from exc
    finally:
        f.seek(0)
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED:
            raise InvalidFileError(
                f"{path}: not a kvactors KV dump: member {m.filename!r} is compressed (method "
                f"{m.compress_type}, {m.file_size} bytes from {m.compress_size}); save_dump "
                "writes stored members, and a compressed one would be allocated at full size",
                path=path,
            )


def _layout_problem(t: torch.Tensor) -> str | None:
    """Why ``t``'s strides are not those of a dense, non-overlapping, in-bounds tensor.

    Only metadata is read. ``torch.save`` keeps a view's storage, sizes and strides, so a file
    can describe a large tensor over a small storage (a stride of 0 repeats one element, or
    strides that make elements alias); comparing it would materialise its full size.
    """
    if t.numel() == 0:
        return None
    dims = sorted((st, n, d) for d, (n, st) in enumerate(zip(t.shape, t.stride(), strict=True)))
    span = 1  # elements covered by the axes of smaller strides, without overlap
    for st, n, d in dims:
        if n == 1:
            continue
        if st == 0:
            return f"has stride 0 on axis {d} (one element repeated {n} times)"
        if st < span:
            return f"has overlapping elements (axis {d}'s stride {st} is below {span})"
        span = st * n
    # torch.load itself refuses a view past its storage (which is not resizable); checked here
    # too, so that the bound does not rest on the loader.
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    storage = t.untyped_storage().nbytes() // t.element_size()
    if last >= storage:
        return f"reaches element {last} of a storage of {storage} elements (out of bounds)"
    return None


def _unreadable(path: str, exc: Exception) -> InvalidFileError:
    first = str(exc).splitlines()[0][:200] if str(exc) else "no details"
    return InvalidFileError(
        f"{path}: not a readable kvactors KV dump ({type(exc).__name__}: {first})", path=path
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def compare_kv(stored: KVDump, restored: KVDump, *, max_report: int = 50) -> ValidationReport:
    """Compare two dumps bit for bit, layer by layer and block position by block position.

    Args:
        stored: The KV as the engine computed and stored it.
        restored: The KV the cache restored (same chunk order; block ids may differ).
        max_report: At most this many :class:`BlockMismatch` entries are listed (all counted).

    Returns:
        The report; ``ok`` is True only when the layouts (layer count, block count, block
        axis, each layer's dtype and shape) and every bit match. Dumps with different block
        axes are a problem, and their bits are not compared.
    """
    problems: list[str] = []
    if len(stored.layers) != len(restored.layers):
        problems.append(f"layer count differs: {len(stored.layers)} vs {len(restored.layers)}")
    if len(stored.block_ids) != len(restored.block_ids):
        problems.append(
            f"block count differs: {len(stored.block_ids)} vs {len(restored.block_ids)}"
        )
    axes_differ = stored.block_dim != restored.block_dim
    if axes_differ:
        # Same bytes under another block axis is another layout: a dumping or layout bug.
        problems.append(
            f"block axis differs: stored block_dim {stored.block_dim} vs restored "
            f"{restored.block_dim} (the blocks are not compared)"
        )
    mismatches: list[BlockMismatch] = []
    bad_blocks = bad_elems = elements = 0
    layers = () if axes_differ else zip(stored.layers, restored.layers, strict=False)
    for li, (a, b) in enumerate(layers):
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(
                f"layer {li}: stored {a.dtype}{list(a.shape)} vs restored {b.dtype}{list(b.shape)}"
            )
            continue
        elements += a.numel()
        ne = _bits(a) != _bits(b)
        per_block = ne.movedim(stored.block_dim, 0).reshape(a.shape[stored.block_dim], -1)
        counts = per_block.sum(dim=1).tolist()
        for pos, count in enumerate(counts):
            if not count:
                continue
            bad_blocks += 1
            bad_elems += int(count)
            if len(mismatches) < max_report:
                mismatches.append(
                    BlockMismatch(
                        layer=li,
                        position=pos,
                        stored_block=_at(stored.block_ids, pos),
                        restored_block=_at(restored.block_ids, pos),
                        elements=int(count),
                        total=per_block.shape[1],
                        first_index=int(per_block[pos].nonzero()[0, 0]),
                    )
                )
    return ValidationReport(
        ok=not problems and bad_blocks == 0,
        layers=len(stored.layers),
        blocks=len(stored.block_ids),
        elements=elements,
        mismatched_blocks=bad_blocks,
        mismatched_elements=bad_elems,
        problems=problems,
        mismatches=mismatches,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _at(ids: tuple[int, ...], pos: int) -> int:
    return ids[pos] if pos < len(ids) else -1


def format_report(r: ValidationReport) -> str:
    """A human-readable report: verdict, problems, then one line per mismatched block."""
    verdict = "IDENTICAL" if r.ok else "MISMATCH"
    lines = [
        f"{verdict}: {r.layers} layers x {r.blocks} blocks ({r.elements} elements); "
        f"{r.mismatched_blocks} (layer, block) pairs differ, {r.mismatched_elements} elements"
    ]
    lines += [f"  problem: {p}" for p in r.problems]
    for m in r.mismatches:
        lines.append(
            f"  layer {m.layer} position {m.position} (stored block {m.stored_block}, restored "
            f"block {m.restored_block}): {m.elements}/{m.total} elements differ, first at "
            f"{m.first_index}"
        )
    if r.mismatched_blocks > len(r.mismatches):
        lines.append(f"  ... {r.mismatched_blocks - len(r.mismatches)} more")
    return "\n".join(lines)
