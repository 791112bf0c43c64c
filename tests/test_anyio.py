"""The ``a*`` API from any anyio backend: the same calls awaited under asyncio and trio."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvactors.core.layouts import Direction
from kvactors.errors import TransferValidationError
from kvactors.runtime import Runtime
from tests.scenarios._kv import expected_gather, objects, paged, request, same

pytest.importorskip("trio")
IDS = (3, 5)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_calls_await_under_every_anyio_backend(backend: str) -> None:
    host = paged(4)
    with Runtime("cpu") as rt:

        async def main() -> None:
            out = objects(1)
            store = rt.atransfer(request(Direction.D2H, IDS), host, out)
            fence = rt.afence(IDS)  # queued behind the store: waits for it
            done = await store
            assert (await fence).block_ids == IDS
            assert done.blocks == len(IDS)
            assert same(out[0], expected_gather(host, IDS)[0])
            assert (await rt.aping(7)).seq == 7
            with pytest.raises(TransferValidationError):
                await rt.atransfer(request(Direction.D2H, (99,)), host, objects(1))
            async with anyio.create_task_group() as tg:  # concurrent awaits
                chunks = [objects(1) for _ in range(4)]
                for c in chunks:
                    tg.start_soon(_await, rt.atransfer(request(Direction.D2H, IDS), host, c))
            for c in chunks:
                assert torch.equal(c[0], out[0])

        anyio.run(main, backend=backend)


async def _await(reply: object) -> None:
    await reply  # type: ignore[misc]


def test_a_cancelled_trio_await_drops_the_answer() -> None:
    host = paged(4)
    with Runtime("cpu") as rt:

        async def main() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await rt.atransfer(request(Direction.D2H, IDS), host, objects(1))
            assert scope.cancelled_caught
            assert (await rt.afence(IDS)).block_ids == IDS  # the runtime still serves

        anyio.run(main, backend="trio")
