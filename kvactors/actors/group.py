"""The actors of one device, wired together: streams, GatherActor, IPCOwnerActor, outboxes.

The actor graph is a DAG: GatherActor and IPCOwnerActor ask StreamActors; StreamActors answer
through reply futures and never send to anyone, so no cycle of bounded sends exists. Stopping
goes down the graph: GatherActor (its transfers finish or fail), IPCOwnerActor (its owners
close after a sync), then the StreamActors (their lanes finish or are abandoned, bounded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from kvactors.actors.actor import ActorStatistics
from kvactors.actors.directory import StreamDirectory
from kvactors.actors.gather import GatherActor
from kvactors.actors.ipc_owner import IPCOwnerActor
from kvactors.actors.outbox import Outbox

if TYPE_CHECKING:
    from kvactors.core.protocols.stream import EventRecord
    from kvactors.devices.base import Backend

__all__ = ("DeviceActors", "DeviceStatistics")


class DeviceStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A frozen snapshot of every actor of one device, plus transfer counters."""

    device: str
    actors: tuple[ActorStatistics, ...]
    transfers_ok: int
    transfers_failed: int
    bytes_moved: int
    inflight: int
    ipc_owners_open: int
    completions_pending: int
    events_pending: int
    stream_syncs: int = 0
    sync_wait_seconds: float = 0.0
    lanes_abandoned: int = 0
    """Stream lanes whose threads did not end within the stop timeout (may still run)."""
    ipc_owners_opened: int = 0
    ipc_owners_closed: int = 0
    """IPC owners closed (after every stream that could use them synchronized)."""
    ipc_owners_kept: int = 0
    """IPC owners kept open, now, because a stream sync before their close failed or timed
    out (a leak is recoverable, a freed mapping under a running copy is not); a later close
    of the context that syncs releases them."""
    records_published: int = 0
    """Completion and event records made drainable (after their stream ran)."""
    records_withdrawn: int = 0
    """Records never published: their stream failed, or the runtime closed first."""
    streams_retired: int = 0
    """Idle borrowed-stream actors stopped and forgotten (bounded threads under churn)."""
    scratch_allocations: int = 0
    """Staging buffers and device index tensors ever allocated for staged (device) transfers;
    flat in steady state (a request with new block ids adds one index upload)."""
    plans_validated: int = 0
    """Transfers validated (plan cache misses): in full, or only their new block ids (see
    ``plans_rebound``); the rest reused a validated plan."""
    plans_rebound: int = 0
    """Of ``plans_validated``, those whose operands' metadata matched a validated plan, so
    that only the block ids were validated (new ids, or data written since)."""
    native_transfers: int = 0
    """Transfers an opted-in native kernel moved."""
    native_declined: int = 0
    """Transfers an opted-in native kernel declined (the torch kernel moved them)."""


class DeviceActors:
    """Creates, starts and stops the actors of one device on the running event loop."""

    def __init__(
        self,
        backend: Backend,
        index: int = 0,
        *,
        capacity: int = 1024,
        stop_timeout: float = 10.0,
    ) -> None:
        self.backend = backend
        self.index = index
        self.device = f"{backend.kind}:{index}"
        self.completions: Outbox[tuple[str, bytes]] = Outbox()
        self.events: Outbox[EventRecord] = Outbox()
        self.streams = StreamDirectory(
            backend=backend,
            index=index,
            completions=self.completions,
            events=self.events,
            capacity=capacity,
            stop_timeout=stop_timeout,
        )
        self.gather = GatherActor(
            f"gather:{self.device}",
            backend=backend,
            index=index,
            streams=self.streams,
            capacity=capacity,
        )
        self.ipc = IPCOwnerActor(
            f"ipc:{self.device}",
            backend=backend,
            streams=self.streams,
            capacity=capacity,
            sync_timeout=stop_timeout,
        )
        self._stop_timeout = stop_timeout

    def start(self) -> None:
        """Start every actor (call on the event loop)."""
        self.streams.get(0)
        self.gather.start()
        self.ipc.start()

    async def stop(self, *, timeout: float | None = None) -> None:
        """Stop down the graph; every pending ask completes or fails within ``timeout`` each."""
        t = self._stop_timeout if timeout is None else timeout
        await self.gather.stop(graceful=True, timeout=t)
        await self.ipc.stop(graceful=True, timeout=t)
        await self.streams.stop(timeout=t)

    @property
    def lanes_abandoned(self) -> int:
        """Stream lanes whose threads did not end within the stop timeout."""
        streams = self.streams
        return streams.retired_lanes_abandoned + sum(s.lanes_abandoned for s in streams.all())

    async def __aenter__(self) -> DeviceActors:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def statistics(self) -> DeviceStatistics:
        """Snapshot every actor of this device."""
        streams = [s.statistics() for s in self.streams.all()]
        actors = (self.gather.statistics(), self.ipc.statistics(), *streams)
        slot = getattr(self.backend, "native", None)  # MLU/MUSA: kvactors.devices.native
        native = getattr(slot, "counters", None)
        return DeviceStatistics(
            device=self.device,
            actors=actors,
            transfers_ok=self.gather.transfers_ok,
            transfers_failed=self.gather.transfers_failed,
            bytes_moved=self.gather.bytes_moved,
            inflight=self.gather.inflight,
            ipc_owners_open=self.ipc.open_owners,
            completions_pending=self.completions.pending,
            events_pending=self.events.pending,
            stream_syncs=sum(s.syncs for s in self.streams.all()),
            sync_wait_seconds=sum(s.sync_seconds for s in self.streams.all()),
            lanes_abandoned=self.lanes_abandoned,
            ipc_owners_opened=self.ipc.owners_opened,
            ipc_owners_closed=self.ipc.owners_closed,
            ipc_owners_kept=self.ipc.owners_kept,
            records_published=self.completions.published + self.events.published,
            records_withdrawn=self.completions.withdrawn + self.events.withdrawn,
            streams_retired=self.streams.retired,
            scratch_allocations=self.gather.scratch_allocations,
            plans_validated=self.gather.plans.misses,
            plans_rebound=self.gather.plans.rebinds,
            native_transfers=native.native_transfers if native is not None else 0,
            native_declined=native.native_declined if native is not None else 0,
        )
