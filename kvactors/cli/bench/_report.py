"""The report types of ``kvactors bench`` (a leaf module: the bench and its plot both read it)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvactors.cli.bench.percall import PercallReport
from kvactors.cli.bench.transfer import BenchRow

__all__ = ("BenchReport", "RuntimeRow")


class RuntimeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One direction through the runtime on a device, against a raw copy."""

    device: str
    simulated: bool
    direction: str
    nbytes: int
    reps: int
    runtime_gbps: float
    raw_gbps: float
    vs_raw: float


class BenchReport(msgspec.Struct, kw_only=True):
    """Everything one ``kvactors bench`` run measured."""

    meta: dict[str, Any]
    transfer: list[BenchRow]
    runtime: list[RuntimeRow]
    vendor: list[dict[str, Any]] | None = None
    percall: PercallReport | None = None
    seconds: float = 0.0
