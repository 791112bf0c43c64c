"""What the fake's tensors, streams and events use of the vendor that owns them.

:class:`Owner` is a Protocol of what they call back into (current stream, memory bookkeeping,
the operation tally); ``FakeVendor`` satisfies it structurally, so the lower modules never
import the vendor module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvactors.testing._counters import OpTally
    from kvactors.testing._device import FakeDevice
    from kvactors.testing._memory import FakeMemory

__all__ = ("CopyKnobs", "Owner", "WorkQueue")


class CopyKnobs(Protocol):
    """The knobs that change how a copy runs (fields of ``FakeKnobs``)."""

    @property
    def strided_d2h_bug(self) -> bool:
        """Reproduce torch_mlu's async strided/converting device-to-host bug."""

    @property
    def pageable_async(self) -> bool:
        """Let ``non_blocking`` copies with unpinned host memory stay asynchronous."""

    @property
    def cross_process(self) -> bool:
        """Export device memory and events so that another process can open them."""


class WorkQueue(Protocol):
    """What device tensors need of a stream: enqueue work, wait for it."""

    def enqueue(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` after the work enqueued so far."""

    def synchronize(self) -> None:
        """Block until the work enqueued so far ran; raise a sticky error."""


class Owner(Protocol):
    """The vendor as its device tensors (and streams and events) see it."""

    @property
    def kind(self) -> str:
        """``"mlu"`` or ``"musa"``."""

    @property
    def knobs(self) -> CopyKnobs:
        """The behaviour switches."""

    @property
    def tally(self) -> OpTally:
        """The device-operation counters."""

    @property
    def memory(self) -> FakeMemory:
        """Which host memory is fake device memory, which is pinned."""

    def device_index(self, device: object) -> int:
        """The ordinal ``device`` names on this vendor."""

    def current_device(self) -> int:
        """The calling thread's current device."""

    def make_device(self, index: int) -> torch.device | FakeDevice:
        """The device object of ordinal ``index``."""

    def current_stream(self, device: object = None) -> WorkQueue:
        """The calling thread's current stream on ``device``."""
