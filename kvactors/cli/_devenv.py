"""Where the user commands run: a real device, or kvactors' fake vendor modules.

Theory of operation. ``kvactors demo --device mlu`` must do something useful on a laptop, so
for ``mlu`` and ``musa`` the real vendor module is used when kvactors' backend probe says it
is available, and otherwise :func:`kvactors.testing.fake_vendor` installs the asynchronous
fake (CPU memory, one worker thread per stream) for the duration of the command, and says so.
``cpu`` is always real, and ``cuda`` runs only on real hardware: there is no CUDA fake. Every
device write or read the commands do outside the runtime goes through :class:`DeviceEnv`, so
the same code works on a plain CPU tensor, a fake device tensor and a real one.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from kvactors.devices import get_backend
from kvactors.errors import BackendUnavailableError, InvalidSettingError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvactors.devices.base import Backend
    from kvactors.testing import FakeVendor

__all__ = ("DEVICE_KINDS", "DeviceEnv", "device_env")

DEVICE_KINDS = ("cpu", "mlu", "musa", "cuda")
"""The ``--device`` choices of the user commands."""


class DeviceEnv:
    """The device a command runs on, and how to move test data to and from it."""

    def __init__(self, kind: str, fake: FakeVendor | None, note: str) -> None:
        self.kind = kind
        self.fake = fake
        self.note = note

    @property
    def simulated(self) -> bool:
        """Whether the device is kvactors' fake vendor module rather than real hardware."""
        return self.fake is not None

    def backend(self) -> Backend:
        """A backend for this device's runtime.

        The commands allocate their paged KV themselves as real NHD ``[2, NB, BS, NH, HS]``,
        so on MLU format 1 is declared ``resolved`` (it is not vLLM-MLU's legacy answer).
        """
        if self.kind == "mlu":
            from kvactors.devices.mlu import MluBackend

            return MluBackend(layout_source="resolved")
        return get_backend(self.kind)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor in device memory (host memory for ``cpu``)."""
        host = torch.zeros(shape, dtype=dtype)
        if self.kind == "cpu":
            return host
        if self.fake is not None:
            return self.fake.adopt(host)
        return host.to(torch.device(self.kind, 0))

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor ``t`` (``t`` itself for ``cpu``)."""
        if self.kind == "cpu":
            return t
        if self.fake is not None:
            return self.fake.to_device(t)
        return t.to(torch.device(self.kind, 0))

    def synchronize(self) -> None:
        """Wait for every stream of the device (a no-op on ``cpu``)."""
        if self.kind != "cpu":
            getattr(torch, self.kind).synchronize()


@contextlib.contextmanager
def device_env(kind: str, *, seed: int = 0, allow_fake: bool = True) -> Iterator[DeviceEnv]:
    """Resolve ``kind`` to a real device, or to the fake vendor module for ``mlu``/``musa``.

    Args:
        kind: One of :data:`DEVICE_KINDS`.
        seed: Seed of the fake streams' jitter (fake devices only).
        allow_fake: Fall back to the fake vendor module when the real one is unavailable.

    Yields:
        The environment; on exit the fake (if any) is drained and uninstalled.

    Raises:
        InvalidSettingError: an unknown kind (a ValueError).
        BackendUnavailableError: the device is unavailable and no fake can stand in.
    """
    if kind not in DEVICE_KINDS:
        raise InvalidSettingError(
            f"unknown device {kind!r}; expected one of {', '.join(DEVICE_KINDS)}", setting="device"
        )
    probe = get_backend(kind).probe()
    if probe.available:
        yield DeviceEnv(kind, None, f"{kind}: real device ({_describe(probe.details)})")
        return
    if kind in ("cpu", "cuda") or not allow_fake:
        raise BackendUnavailableError(backend=kind, reason=probe.reason)
    from kvactors.testing import fake_vendor

    vendor = {"mlu": "torch_mlu", "musa": "torch_musa"}[kind]
    try:
        cm = fake_vendor(kind, seed=seed, jitter=0.0002)
        fake = cm.__enter__()
    except RuntimeError as exc:  # the real module is importable but has no device
        raise BackendUnavailableError(
            backend=kind,
            reason=f"{probe.reason}; the fake {vendor} cannot stand in ({exc})",
        ) from exc
    note = (
        f"{kind}: SIMULATED - {vendor} is not usable here ({probe.reason}); running on the "
        f"fake {vendor} from kvactors.testing (CPU memory, asynchronous fake streams)"
    )
    try:
        yield DeviceEnv(kind, fake, note)
    finally:
        cm.__exit__(None, None, None)


def _describe(details: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(details.items())) or "no details"
