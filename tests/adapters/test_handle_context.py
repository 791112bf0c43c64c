"""The MUSA cache-context class of the handle path is built once, not per call."""

from __future__ import annotations

import pytest

from .conftest import LMCACHE_MISSING, SKIP_REASON

pytestmark = [pytest.mark.lmcache, pytest.mark.skipif(LMCACHE_MISSING, reason=SKIP_REASON)]


def test_every_context_is_an_instance_of_one_class() -> None:
    from kvactors_lmcache.handle import _context_class

    cls = _context_class()
    assert _context_class() is cls
    assert cls.__name__ == "KvactorsMusaCacheContext"
