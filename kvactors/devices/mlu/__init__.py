"""The Cambricon MLU backend (``torch_mlu``) and its vLLM-MLU layout rules.

``backend``: :class:`MluBackend`; ``layouts``: what an MLU transfer request means (pure).
"""

from kvactors.devices.mlu.backend import NATIVE_TRANSFER_ENV as NATIVE_TRANSFER_ENV
from kvactors.devices.mlu.backend import MluBackend as MluBackend

__all__ = ("NATIVE_TRANSFER_ENV", "MluBackend")
