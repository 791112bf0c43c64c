"""A chunk must lie inside its storage: one whose storage shrank under it (the tensor's
metadata unchanged) is refused before anything is copied, also after its plan was cached."""

from __future__ import annotations

import pytest
import torch

from kvactors.core.layouts import KVFormat
from kvactors.errors import TransferValidationError
from kvactors.runtime import Runtime
from tests._transfer_cases import Case, same_bytes, snapshot

CASE = Case(KVFormat.NL_X_TWO_NB_BS_NH_HS, nl=2, nb=8, bs=2, nh=2, hs=4, dtype=torch.float32,
            alloc="stacked", seed=1, n_objects=1, bpo=2)  # fmt: skip


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("direction", [0, 1])
def test_a_chunk_past_its_storage_is_refused(direction: int, cached: bool) -> None:
    paged, objs, backing = CASE.build()
    with Runtime("cpu") as rt:
        if cached:  # the same layout planned and run before, on a whole chunk
            rt.transfer(CASE.request(direction, [3, 5, 1, 6]), paged, [objs[0].clone()])
        chunk = objs[0].clone()
        chunk.untyped_storage().resize_(16)
        before = snapshot(backing)
        with pytest.raises(TransferValidationError, match="past its storage"):
            rt.transfer(CASE.request(direction, [3, 5, 1, 6]), paged, [chunk])
        assert same_bytes(backing, before)  # nothing copied
