"""Which LMCache device backend would be selected here, predicted without importing lmcache.

Theory of operation. kvactors never imports lmcache (importing it runs device detection,
loads every plugin, and can raise), so ``kvactors doctor`` replays LMCache 0.5.6's rules
(``lmcache/v1/platform/_device_detect.py``; ``lmcache-contract.md`` section 1.3) on facts it
gathers itself: the built-in backends (a fixed list for 0.5.6, with availability guessed from
torch and from which vendor packages are importable), the plugins registered in the
``lmcache.device_plugins`` entry-point group, kvactors' own probes, and the environment:

1. ``LMCACHE_DEVICE_BACKEND=<name>``: that backend must be registered and available, else
   ``import lmcache`` raises ``RuntimeError``.
2. ``DEVICE_TYPE=<type>``: exactly one available backend of that type wins; two raise; none
   falls through (with a warning) to auto-detection.
3. Auto-detection walks the device types in registry order (built-ins first: cpu, cuda, hpu,
   musa, neuron, npu, rbln, xpu; then plugin-only types such as mlu) and takes the first type
   with exactly one available backend; two available backends of one type raise.
4. Nothing available: LMCache's own ``StubCPUDevice`` (kvactors is not used).

``LMCACHE_MP_TRANSFER_MODE`` (``auto`` by default) then picks the MP transfer path; kvactors'
specs answer ``engine_driven`` for ``auto``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvactors.plugins import PLUGIN_MUSA, PLUGINS

__all__ = ("BUILTIN_BACKENDS", "Selection", "SpecFact", "predict_selection")

BUILTIN_BACKENDS: tuple[tuple[str, str], ...] = (
    ("cpu", "cpu"),
    ("cuda", "cuda"),
    ("hpu", "hpu"),
    ("musa", "musa"),
    ("neuron", "neuron"),
    ("npu", "npu"),
    ("rbln", "rbln"),
    ("rocm", "cuda"),
    ("xpu", "xpu"),
)
"""LMCache 0.5.6's built-in ``(backend_name, device_type)`` pairs, in registry order."""

KVACTORS_PLUGINS = PLUGINS
"""kvactors' plugin backend names and their device types."""

_MODES = ("auto", "engine_driven", "lmcache_driven")


class SpecFact(msgspec.Struct, frozen=True, kw_only=True):
    """What kvactors knows about one LMCache backend here."""

    backend: str
    device_type: str
    origin: Literal["builtin", "plugin"]
    """``builtin`` or ``plugin``."""
    available: bool
    reason: str = ""


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The predicted outcome of LMCache's device detection and transfer-mode choice."""

    outcome: Literal["selected", "error", "stub"]
    """``selected``, ``error`` (``import lmcache`` would raise) or ``stub``."""
    backend: str | None
    device_type: str
    kvactors: bool
    """Whether the selected backend is one of kvactors' plugins."""
    reason: str
    transfer_mode: str
    transfer_mode_reason: str
    error: str = ""


def _choose(cands: list[SpecFact]) -> tuple[SpecFact | None, str]:
    avail = [c for c in cands if c.available]
    if len(avail) == 1:
        return avail[0], ""
    if len(avail) > 1:
        names = ", ".join(sorted(c.backend for c in avail))
        return None, (
            f"Multiple LMCache backends are available for device_type "
            f"{cands[0].device_type!r}: {names}. Set LMCACHE_DEVICE_BACKEND=<backend_name> "
            "to choose one explicitly."
        )
    return None, "none available"


def predict_selection(specs: list[SpecFact], env: dict[str, str]) -> Selection:
    """Replay LMCache 0.5.6's detection on ``specs`` (registry order) and ``env``."""
    chosen: SpecFact | None = None
    error = ""
    reason = ""
    explicit = env.get("LMCACHE_DEVICE_BACKEND", "").strip().lower()
    device_type = env.get("DEVICE_TYPE", "").strip().lower()
    by_name = {s.backend: s for s in specs}
    if explicit:
        spec = by_name.get(explicit)
        if spec is None:
            error = (
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is not a registered LMCache backend "
                f"(registered: {', '.join(sorted(by_name))})"
            )
        elif not spec.available:
            error = (
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is registered but not available"
                + (f": {spec.reason}" if spec.reason else "")
            )
        else:
            chosen, reason = spec, f"LMCACHE_DEVICE_BACKEND={explicit}"
    else:
        types: list[str] = []
        for s in specs:
            if s.device_type not in types:
                types.append(s.device_type)
        if device_type:
            found, why = _choose([s for s in specs if s.device_type == device_type])
            if found is not None:
                chosen, reason = found, f"DEVICE_TYPE={device_type}"
            elif why != "none available":
                error = why
            else:
                reason = f"DEVICE_TYPE={device_type} has no available backend; auto-detection. "
        if chosen is None and not error:
            for t in types:
                found, why = _choose([s for s in specs if s.device_type == t])
                if found is not None:
                    chosen = found
                    reason += f"auto-detection: first device type with one available backend ({t})"
                    break
                if why != "none available":
                    error = why
                    break
    mode, mode_reason, mode_error = _transfer_mode(chosen, env)
    if error:
        return Selection(
            outcome="error", backend=None, device_type="", kvactors=False,
            reason="import lmcache would raise RuntimeError", error=error,
            transfer_mode=mode, transfer_mode_reason=mode_reason,
        )
    if chosen is None:
        return Selection(
            outcome="stub", backend=None, device_type="cpu", kvactors=False,
            reason=reason + "no backend available: LMCache's StubCPUDevice (kvactors unused)",
            transfer_mode=mode, transfer_mode_reason=mode_reason, error=mode_error,
        )
    return Selection(
        outcome="error" if mode_error else "selected",
        backend=chosen.backend,
        device_type=chosen.device_type,
        kvactors=chosen.origin == "plugin" and chosen.backend in KVACTORS_PLUGINS,
        reason=reason,
        transfer_mode=mode,
        transfer_mode_reason=mode_reason,
        error=mode_error,
    )


def _transfer_mode(chosen: SpecFact | None, env: dict[str, str]) -> tuple[str, str, str]:
    raw = env.get("LMCACHE_MP_TRANSFER_MODE", "").strip().lower()
    if raw and raw not in _MODES:
        return raw, "LMCACHE_MP_TRANSFER_MODE", (
            f"Invalid MP transfer mode {raw!r} (valid: {', '.join(_MODES)})"
        )
    if raw and raw != "auto":
        if raw == "lmcache_driven" and chosen is not None and chosen.backend in KVACTORS_PLUGINS:
            handle = env.get("LMCACHE_MUSA_HANDLE_TRANSFER", "").strip().lower()
            if chosen.backend != PLUGIN_MUSA or handle not in ("1", "true", "yes", "on"):
                return raw, "LMCACHE_MP_TRANSFER_MODE", (
                    f"{chosen.backend} does not offer the lmcache_driven (handle) path"
                    + (" without LMCACHE_MUSA_HANDLE_TRANSFER=1" if chosen.backend ==
                       PLUGIN_MUSA else "")
                    + "; use LMCACHE_MP_TRANSFER_MODE=engine_driven"
                )
        return raw, "LMCACHE_MP_TRANSFER_MODE", ""
    if chosen is not None and chosen.backend in KVACTORS_PLUGINS:
        return "engine_driven", "auto: kvactors' default_mp_transfer_mode()", ""
    if chosen is not None and chosen.backend in ("cuda", "npu"):
        return "lmcache_driven", "auto: the built-in backend's default (when available)", ""
    return "engine_driven", "auto: LMCache's default for this device", ""
