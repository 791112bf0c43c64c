"""kvactors: an asyncio actor runtime for KV-cache transfers on MLU, MUSA and CPU."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ("__version__",)
