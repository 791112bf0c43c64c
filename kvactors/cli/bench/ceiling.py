"""The C ceiling of a transfer's access pattern, timed over the benchmark's own operands.

Theory of operation. A gather or scatter moves *pieces* (one block plane of one layer) between
random places of the paged memory and a token-major host chunk; inside a piece it copies
``run``-byte runs laid out in a 2-D strided pattern (one run for NHD and MLA, whose block
planes are token-major already; ``BS x NH`` runs of ``HS`` elements for HND, whose block planes
are transposed on the way). The fastest a host can do that is a C ``memcpy`` loop over exactly
those runs, with no torch or Python in between: the same loop as
``benchmarks/gather_limit.c``, compiled here into a small shared library with the system C
compiler (``cc -O2``, as that program is built) and called through :mod:`ctypes` on piece
pointers taken from the very tensors the benchmark times kvactors on. The ratio
kvactors / ceiling then compares two movers of the same bytes, between the same addresses, in
the same run. Without a C compiler (or where ctypes cannot load the library) there is no
ceiling; the benchmark says so and skips the column.

Where a piece is several runs (HND), the loop can walk it in the chunk's order (token-major,
"dst order" of a gather in ``gather_limit.c``) or the paged memory's (head-major); both are
timed and the faster is the ceiling. ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from kvactors.kernels._views import canonical_unit, object_view

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from kvactors.layouts import FormatSpec

__all__ = ("ceiling_library", "ceiling_movers")

_SOURCE = r"""
#include <stddef.h>
#include <string.h>

/* For every piece i: na x nb runs of `run` bytes, run (a, b) at dst[i] + a*da + b*db and
 * src[i] + a*sa + b*sb. */
void kv_copy_pieces(size_t n, char *const *dst, char *const *src, size_t na, size_t nb,
                    size_t da, size_t db, size_t sa, size_t sb, size_t run) {
    for (size_t i = 0; i < n; i++) {
        char *d = dst[i];
        const char *s = src[i];
        for (size_t a = 0; a < na; a++)
            for (size_t b = 0; b < nb; b++)
                memcpy(d + a * da + b * db, s + a * sa + b * sb, run);
    }
}
"""

_LIB: list[ctypes.CDLL | None] = []


def ceiling_library() -> ctypes.CDLL | None:
    """The compiled ceiling loop, or ``None`` when no C compiler is available (built once per
    process, in a temporary directory removed right after loading)."""
    if _LIB:
        return _LIB[0]
    lib: ctypes.CDLL | None = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is not None:
        tmp = tempfile.mkdtemp(prefix="kvactors-ceiling-")
        try:
            src = os.path.join(tmp, "ceiling.c")
            so = os.path.join(tmp, "libceiling.so")
            with open(src, "w") as f:
                f.write(_SOURCE)
            done = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", src, "-o", so],
                capture_output=True,
                check=False,
                timeout=60,
            )
            if done.returncode == 0:
                lib = ctypes.CDLL(so)
                fn = lib.kv_copy_pieces
                fn.restype = None
                fn.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
                fn.argtypes += [ctypes.c_size_t] * 7
        except (OSError, subprocess.SubprocessError):
            lib = None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _LIB.append(lib)
    return lib


def ceiling_movers(
    spec: FormatSpec,
    units: Sequence[torch.Tensor],
    objects: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    *,
    nl: int,
    nh: int,
    hs: int,
    bs: int,
    gather: bool,
) -> list[Callable[[], None]]:
    """Calls that move the transfer's bytes with the C loop, one per walk order inside a
    piece (two when a piece is several runs, as for HND: token-major or head-major first; the
    benchmark keeps the faster, so the ceiling is the best a plain loop does); empty without a
    C compiler, or for a layout whose head axis is not contiguous.

    Args:
        spec: The paged layout.
        units: The paged tensors as the plugin receives them (flattened K/V lists).
        objects: The host chunks, in call order; ``block_ids`` are split over them in order.
        block_ids: The request's block ids.
        nl, nh, hs, bs: The cache shape (``nh`` 1 for MLA).
        gather: Paged -> chunks (``True``) or chunks -> paged.
    """
    lib = ceiling_library()
    if lib is None:
        return []
    esz = units[0].element_size()
    cus = [canonical_unit(spec, t) for t in units]
    _, _, s_s, s_h, s_d = cus[0].stride()
    if s_d != 1 or any(c.stride() != cus[0].stride() for c in cus):
        return []
    planes = spec.planes
    heads = 1 if spec.is_mla else nh
    # The runs inside one piece: the chunk side is token-major [S][H][D], contiguous.
    orders: list[tuple[int, int, int, int, int, int, int]]  # na, nb, paged a/b, chunk a/b, run
    # One head (MLA): the head axis is a size-1 axis, its stride means nothing.
    if (heads == 1 or s_h == hs) and s_s == heads * hs:
        orders = [(1, 1, 0, 0, 0, 0, bs * heads * hs * esz)]  # the block plane is one run
    else:
        run = hs * esz
        p_s, p_h, c_s, c_h = s_s * esz, s_h * esz, heads * run, run
        orders = [(bs, heads, p_s, p_h, c_s, c_h, run), (heads, bs, p_h, p_s, c_h, c_s, run)]
    piece = bs * heads * hs * esz
    chunk_ptrs: list[int] = []
    paged_ptrs: list[int] = []
    ids = list(block_ids)
    for c, obj in enumerate(objects):
        slots = object_view(spec, obj, nl, nh, hs, bs).size(2)
        base = obj.data_ptr()
        for p in range(planes):
            for layer in range(nl):
                cu, pp = (cus[p * nl + layer], 0) if spec.is_kv_list else (cus[layer], p)
                for j in range(slots):
                    b = ids[c * slots + j]
                    chunk_ptrs.append(base + ((p * nl + layer) * slots + j) * piece)
                    paged_ptrs.append(cu.data_ptr() + (pp * cu.stride(0) + b * cu.stride(1)) * esz)
    cp = np.asarray(chunk_ptrs, dtype=np.uintp)
    pp_ = np.asarray(paged_ptrs, dtype=np.uintp)
    dst, src = (cp, pp_) if gather else (pp_, cp)
    fn = lib.kv_copy_pieces
    keep = (dst, src, units, objects)  # the pointer arrays and operands outlive the movers

    def mover(na: int, nb: int, pa: int, pb: int, ca: int, cb: int, run: int) -> Callable[[], None]:
        da, db, sa, sb = (ca, cb, pa, pb) if gather else (pa, pb, ca, cb)
        args = (len(cp), dst.ctypes.data, src.ctypes.data, na, nb, da, db, sa, sb, run)

        def run_c() -> None:
            assert keep
            fn(*args)

        return run_c

    return [mover(*o) for o in orders]
