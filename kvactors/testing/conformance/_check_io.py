"""Operands for :mod:`~kvactors.testing.conformance.check`: device memory, KV cases, the oracle.

:class:`DeviceIO` moves test data to and from device memory (torch's ``.to()`` on a card, the
fake's helpers on the fakes); :meth:`DeviceIO.read_unordered` reads without waiting for any
stream, as ordering checks need. :class:`KVCase` builds one deterministic paged cache and its
chunks for any format; the reference kernel on CPU copies is the oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvactors.core.layouts import FORMAT_SPECS, KVFormat, PagedKind, ShapeDesc
from kvactors.core.plans import TransferRequest, plan_transfer
from kvactors.kernels.reference import run_reference

if TYPE_CHECKING:
    from kvactors.devices.base import Backend
    from kvactors.testing.vendor import FakeVendor

__all__ = ("DeviceIO", "KVCase", "same_bytes")

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(_RAW[t.element_size()])


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two tensor lists hold identical bytes, tensor by tensor."""
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(_raw(x), _raw(y)) for x, y in zip(a, b, strict=True)
    )


class DeviceIO:
    """Moves test data between host and the device under test.

    Args:
        backend: The backend under test.
        index: Its device index.
        fake: The installed fake vendor when the device is simulated, else None.
    """

    def __init__(self, backend: Backend, index: int, fake: FakeVendor | None) -> None:
        self.backend = backend
        self.kind = backend.kind
        self.index = index
        self.fake = fake

    @property
    def is_host(self) -> bool:
        """Whether the device memory is host memory (the CPU backend)."""
        return self.kind == "cpu"

    def vendor(self) -> Any:
        """The vendor module (``torch.mlu`` ...) of an accelerator backend."""
        return getattr(self.backend, "module")  # noqa: B009 - TorchLikeBackend attribute

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor ``t`` (complete on return)."""
        if self.is_host:
            return t.clone()
        if self.fake is not None:
            return self.fake.to_device(t, self.index)
        out = t.to(self.backend.device(self.index))
        self.vendor().synchronize(self.index)
        return out

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned (where the backend can) host copy of host tensor ``t``."""
        return self.backend.pin(t.clone())

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The bytes of device tensor ``t`` after every stream of the device finished."""
        if self.is_host:
            return t.clone()
        if self.fake is not None:
            self.vendor().synchronize(self.index)
            return self.fake.peek(t)
        self.vendor().synchronize(self.index)
        return t.to("cpu")

    def settle(self) -> None:
        """Wait for every stream of the device; errors are left to the next check."""
        if self.is_host:
            return
        with contextlib.suppress(Exception):
            self.vendor().synchronize(self.index)

    def read_unordered(self, t: torch.Tensor) -> torch.Tensor:
        """The bytes of device tensor ``t`` now, waiting for no earlier stream work.

        Real devices copy on a fresh stream, which is not ordered after any other stream.
        """
        if self.is_host:
            return t.clone()
        if self.fake is not None:
            return self.fake.peek(t)
        mod = self.vendor()
        side = mod.Stream(device=self.index)
        with mod.stream(side):
            out = t.to("cpu")
        side.synchronize()
        return out


@dataclasses.dataclass(frozen=True)
class KVCase:
    """One deterministic paged KV cache and chunk geometry for a format."""

    fmt: KVFormat
    nl: int = 2
    nb: int = 8
    bs: int = 4
    nh: int = 2
    hs: int = 8
    bpo: int = 2
    dtype: torch.dtype = torch.float16

    @property
    def heads(self) -> int:
        """KV heads (1 for MLA formats)."""
        return 1 if FORMAT_SPECS[self.fmt].is_mla else self.nh

    def shape(self) -> ShapeDesc:
        """The shape descriptor, with the exact dtype name."""
        spec = FORMAT_SPECS[self.fmt]
        return ShapeDesc(
            kv_size=spec.planes,
            nl=self.nl,
            nb=self.nb,
            bs=self.bs,
            nh=self.heads,
            hs=self.hs,
            element_size=torch.empty(0, dtype=self.dtype).element_size(),
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def request(self, direction: int, block_ids: list[int], skip: int = 0) -> TransferRequest:
        """A request over ``block_ids`` (chunks of ``bpo`` blocks)."""
        return TransferRequest(
            fmt=int(self.fmt),
            direction=direction,
            block_ids=tuple(block_ids),
            chunk_size=self.bpo * self.bs,
            skip_blocks=skip,
            shape=self.shape(),
        )

    def n_objects(self, n_blocks: int) -> int:
        """Host chunks needed for ``n_blocks`` block ids."""
        return -(-n_blocks // self.bpo)

    def units(self, gen: torch.Generator) -> list[torch.Tensor]:
        """Random host paged tensors, one per unit (layer, plane list or cross-layer)."""
        spec = FORMAT_SPECS[self.fmt]
        shape = spec.tensor_shape(self.nl, self.nb, self.bs, self.heads, self.hs)
        n = {PagedKind.CROSS_LAYER: 1, PagedKind.LAYER_LIST: self.nl}.get(spec.kind, 2 * self.nl)
        return [self._random(shape, gen) for _ in range(n)]

    def objects(self, n: int, gen: torch.Generator | None) -> list[torch.Tensor]:
        """``n`` host chunks: random bytes, or zeros when ``gen`` is None."""
        spec = FORMAT_SPECS[self.fmt]
        shape = spec.object_shape(self.nl, self.bpo * self.bs, self.heads, self.hs)
        if gen is None:
            return [torch.zeros(shape, dtype=self.dtype) for _ in range(n)]
        return [self._random(shape, gen) for _ in range(n)]

    def paged(self, units: list[torch.Tensor]) -> Any:
        """The paged operand the format expects, built from ``units``."""
        kind = FORMAT_SPECS[self.fmt].kind
        if kind is PagedKind.CROSS_LAYER:
            return units[0]
        if kind is PagedKind.KV_LIST:
            return [units[: self.nl], units[self.nl :]]
        if kind is PagedKind.KV_PAIRS:
            return [(units[i], units[self.nl + i]) for i in range(self.nl)]
        return list(units)

    def reference(
        self, request: TransferRequest, units: list[torch.Tensor], objects: list[torch.Tensor]
    ) -> None:
        """Run the reference kernel on host ``units`` and ``objects`` (in place)."""
        paged = self.paged(units)
        run_reference(plan_transfer(request, paged, objects, device_type="cpu"), paged, objects)

    def _random(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        t = torch.empty(shape, dtype=self.dtype)
        # Finite values only: a NaN payload would still compare bit-exact, but keep the
        # data printable in failure details.
        t.copy_(torch.randint(-2048, 2048, shape, generator=gen).to(self.dtype) / 64)
        return t
