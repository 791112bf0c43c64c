"""The LMCache device plugin backed by the kvactors runtime.

Importing any ``kvactors_lmcache`` module first runs ``import lmcache`` here: LMCache detects
devices and loads its device plugins (this package's ``spec`` and ``ops``) while it
initialises, so initialising it before one of our modules starts executing keeps the import
order of user code irrelevant (otherwise ``import kvactors_lmcache.ops`` before ``lmcache``
would make LMCache find a half-initialised module and skip the plugin).
"""

from __future__ import annotations

import importlib.util as _importlib_util

if _importlib_util.find_spec("lmcache") is not None:
    import lmcache as _lmcache  # noqa: F401
