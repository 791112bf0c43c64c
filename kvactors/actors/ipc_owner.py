"""IPCOwnerActor: receiver-side owners of IPC-opened memory, closed only after a stream sync.

Closing a context (rule 2): a ``Sync`` barrier on every stream this device's directory knows
plus the handles the caller names, and the end of every retired stream actor still stopping
(its lane may still watch a copy that reads a view); then drop the views, then close each
owner (each in its own ``finally``). If a barrier failed or timed out nothing is released:
the context stays open, ``owners_kept`` counts its owners, the close raises
:class:`~kvactors.errors.IPCError` and a later close tries again. A second close of a
context being closed gets the first one's answer; only the handle (a name and metadata, never
a pointer) crosses processes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Any

from kvactors.actors.actor import Actor
from kvactors.actors.envelope import DEFERRED, Envelope, unreachable
from kvactors.actors.reply import Reply
from kvactors.core.protocols.ipc import CloseContext, ContextClosed, IPCRequest, Opened, OpenHandle
from kvactors.core.protocols.stream import Sync
from kvactors.errors import DeviceOpError, IPCError, ProtocolError, translate

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import torch

    from kvactors.actors.directory import StreamDirectory
    from kvactors.actors.stream import StreamActor
    from kvactors.devices.base import Backend, IPCOwner

__all__ = ("IPCOwnerActor",)

_log = logging.getLogger(__name__)


class IPCOwnerActor(Actor[IPCRequest]):
    """Holds opened IPC owners per context and closes them in the safe order."""

    accepts = (OpenHandle, CloseContext)

    def __init__(
        self,
        name: str,
        *,
        backend: Backend,
        streams: StreamDirectory,
        capacity: int = 1024,
        sync_timeout: float | None = None,
    ) -> None:
        super().__init__(name, capacity=capacity)
        self.backend = backend
        self._streams = streams
        self._owners: dict[int, dict[int, IPCOwner]] = {}
        self._views: dict[int, dict[int, torch.Tensor]] = {}
        # Contexts whose close is in flight -> the settle callbacks of the later closes that
        # wait for it (each gets the first close's outcome).
        self._closing: dict[int, list[Callable[[BaseException | None, Any], None]]] = {}
        self._closed: set[int] = set()
        self._owner_ids = itertools.count(1)
        self._sync_timeout = sync_timeout
        self.owners_opened = 0
        self.owners_closed = 0
        self._kept: dict[int, int] = {}  # context -> owners kept open after a failed sync

    @property
    def owners_kept(self) -> int:
        """Owners kept open now because a sync before their close failed or timed out."""
        return sum(self._kept.values())

    @property
    def open_owners(self) -> int:
        """Owners currently open across every context."""
        return sum(len(o) for o in self._owners.values())

    def receive(self, env: Envelope[IPCRequest]) -> Any:
        """Dispatch one message."""
        msg = env.msg
        match msg:
            case OpenHandle():
                return self._open(msg)
            case CloseContext():
                return self._close(env, msg)
            case _:
                return unreachable(msg)

    def _open(self, msg: OpenHandle) -> tuple[Opened, torch.Tensor]:
        ctx = msg.context_id
        if ctx in self._closed or ctx in self._closing:
            raise ProtocolError(
                f"context {ctx} is closed or closing", actor=self.name, state="closed"
            )
        owner = self.backend.ipc_open(msg.handle)
        oid = next(self._owner_ids)
        self._owners.setdefault(ctx, {})[oid] = owner
        view = owner.tensor
        self._views.setdefault(ctx, {})[oid] = view
        self.owners_opened += 1
        return Opened(context_id=ctx), view

    def _close(self, env: Envelope[IPCRequest], msg: CloseContext) -> Any:
        ctx = msg.context_id
        waiters = self._closing.get(ctx)
        if waiters is not None:
            waiters.append(self.defer(env))
            return DEFERRED
        if ctx not in self._owners:
            return ContextClosed(context_id=ctx, owners_closed=0)
        # Every stream this device knows, plus the named ones (borrowed now if new). A bad
        # handle fails this close before anything changed: the context stays open.
        streams = {id(s): s for s in self._streams.all()}
        for h in dict.fromkeys(msg.stream_handles):
            named = self._streams.get(h)
            streams.setdefault(id(named), named)
        self._closing[ctx] = []
        settle = self.defer(env)
        syncs = self._barriers(list(streams.values()))
        gathered = asyncio.gather(*syncs, return_exceptions=True)

        def after_sync(f: asyncio.Future[list[Any]]) -> None:
            sync_errors = [r for r in f.result() if isinstance(r, BaseException)]
            later = self._closing.pop(ctx, [])
            closed = 0
            if sync_errors:
                failure: BaseException | None = self._keep(ctx, sync_errors)
            else:
                closed, errors = self._release(ctx)
                # The first failure, as the vocabulary maps it: a kvactors error (a live view)
                # as it is; a foreign one (a vendor close) becomes an IPCError naming the
                # context and every failure.
                failure = (
                    translate(
                        errors[0],
                        lambda _m: IPCError(f"context {ctx} closed with errors: {errors!r}"),
                    )
                    if errors
                    else None
                )
            for done in (settle, *later):
                if failure is not None:
                    done(failure, None)
                else:
                    done(None, ContextClosed(context_id=ctx, owners_closed=closed))

        gathered.add_done_callback(after_sync)
        return DEFERRED

    def _barriers(self, streams: list[StreamActor]) -> list[Awaitable[Any]]:
        # A stream that cannot take a Sync (broken, closed) yields a failed barrier, so the
        # close still runs to the end and reports the failure instead of stalling. A retired
        # actor still stopping is waited for until its lane ended (its reaper dropped every
        # lease, so every copy it launched completed).
        out: list[Awaitable[Any]] = [
            self._retired_end(actor, task) for actor, task in self._streams.retiring()
        ]
        for stream in streams:
            try:
                out.append(stream.ask_nowait(Sync(), timeout=self._sync_timeout))
            except Exception as exc:
                failed: Reply[Any] = Reply()
                failed.settle(exc)
                out.append(failed)
        return out

    async def _retired_end(self, actor: StreamActor, task: asyncio.Task[None]) -> None:
        # shield: a timed-out barrier must not cancel the retirement itself.
        await asyncio.wait_for(asyncio.shield(task), self._sync_timeout)
        if actor.lanes_abandoned:
            raise DeviceOpError(
                f"{actor.name}: retired, and its lane did not end (work it launched may still run)",
                device=f"{self.backend.kind}:{actor.index}",
                op="synchronize",
            )

    def _keep(self, ctx: int, sync_errors: list[BaseException]) -> IPCError:
        # Close after sync (rule 2): a stream that did not sync may still copy through the
        # views, so the owners stay open and are counted; the context stays closable.
        kept = len(self._owners.get(ctx, {}))
        self._kept[ctx] = kept
        err = IPCError(
            f"context {ctx}: {kept} IPC owner(s) kept open, not released: a stream sync "
            f"before the close failed or timed out, so a copy may still use them "
            f"({sync_errors[0]!r}); close the context again once the streams are idle"
        )
        err.__cause__ = sync_errors[0]
        return err

    def _release(self, ctx: int) -> tuple[int, list[BaseException]]:
        # Drop the views first: an owner must never be closed under a live view we hold.
        self._kept.pop(ctx, None)
        self._views.pop(ctx, None)
        owners = self._owners.pop(ctx, {})
        errors: list[BaseException] = []
        closed = 0
        for owner in owners.values():
            try:
                owner.close()
                closed += 1
                self.owners_closed += 1
            except Exception as exc:
                errors.append(exc)
        self._closed.add(ctx)
        return closed, errors

    async def on_stop(self, closed: Any) -> None:
        """Close every context still open after a sync of every stream (bounded); if a sync
        failed or timed out, keep them open (counted in ``owners_kept``) and log it."""
        if not self._owners:
            return
        syncs = self._barriers(self._streams.all())
        results = await asyncio.gather(*syncs, return_exceptions=True)
        sync_errors = [r for r in results if isinstance(r, BaseException)]
        for ctx in list(self._owners):
            if ctx in self._closing:
                continue
            if sync_errors:
                _log.error("%s", self._keep(ctx, sync_errors), extra={"actor": self.name})
            else:
                self._release(ctx)
