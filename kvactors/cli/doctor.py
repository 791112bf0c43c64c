"""``kvactors doctor``: what can run here, what LMCache would select, and what to do about it.

Everything is read without side effects: packages through ``importlib.metadata`` and
``importlib.util.find_spec`` (lmcache and the adapter are never imported: importing lmcache
runs its device detection), backends through kvactors' probes (which never raise), and the
LMCache selection is predicted by :mod:`kvactors.cli._selection`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Literal

import msgspec

from kvactors.cli._selection import (
    BUILTIN_BACKENDS,
    KVACTORS_PLUGINS,
    Selection,
    SpecFact,
    predict_selection,
)
from kvactors.devices import BACKEND_KINDS, Probe, probe_all
from kvactors.plugins import PLUGIN_CPU, PLUGIN_MLU, PLUGIN_MUSA

__all__ = ("ENV_VARS", "DoctorReport", "Finding", "collect", "format_doctor")

ENV_VARS = (
    "LMCACHE_DEVICE_BACKEND",
    "DEVICE_TYPE",
    "LMCACHE_MP_TRANSFER_MODE",
    "KVACTORS_LMCACHE_CPU",
    "LMCACHE_MUSA_HANDLE_TRANSFER",
    "MLU_VISIBLE_DEVICES",
    "MUSA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)
"""Environment variables that change what kvactors or LMCache do."""

_VENDOR_DISTS = {
    "torch": ("torch",),
    "torch_mlu": ("torch_mlu", "torch-mlu"),
    "torch_musa": ("torch_musa", "torch-musa"),
    "lmcache": ("lmcache",),
}
_PLUGIN_GROUP = "lmcache.device_plugins"
_LMCACHE_TESTED = "0.5.6"


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One observation: ``level`` is ``ok``, ``info``, ``warn`` or ``error``."""

    level: Literal["ok", "info", "warn", "error"]
    topic: str
    message: str
    fix: str = ""


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``kvactors doctor`` found."""

    python: str
    platform: str
    kvactors: str
    packages: dict[str, str | None]
    torch_threads: int
    backends: list[Probe]
    plugins: dict[str, str]
    adapter_importable: bool
    selection: Selection
    env: dict[str, str]
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        """No finding at level ``error``."""
        return all(f.level != "error" for f in self.findings)


def _version(names: tuple[str, ...]) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    top = names[0]
    try:
        return "unknown version" if importlib.util.find_spec(top) is not None else None
    except (ImportError, ValueError):
        return None


def _plugins() -> dict[str, str]:
    try:
        eps = importlib.metadata.entry_points(group=_PLUGIN_GROUP)
    except Exception:
        return {}
    return {ep.name: ep.value for ep in sorted(eps, key=lambda e: (e.name, e.value))}


def _spec_facts(
    probes: dict[str, Probe], plugins: dict[str, str], env: dict[str, str]
) -> list[SpecFact]:
    import torch

    cuda = bool(torch.cuda.is_available())
    facts: list[SpecFact] = []
    for name, dtype in BUILTIN_BACKENDS:
        if name == "cpu":
            avail, why = False, "LMCache's built-in CPU spec never reports available"
        elif name == "cuda":
            avail, why = cuda and torch.version.cuda is not None, "torch.cuda"
        elif name == "rocm":
            avail, why = cuda and getattr(torch.version, "hip", None) is not None, "torch.cuda+hip"
        elif name == "musa":
            avail, why = probes["musa"].available, probes["musa"].reason
        elif name == "xpu":
            xpu = getattr(torch, "xpu", None)
            avail = bool(xpu is not None and xpu.is_available())
            why = "torch.xpu"
        else:
            avail, why = False, "not checked by kvactors (assumed unavailable)"
        facts.append(SpecFact(backend=name, device_type=dtype, origin="builtin",
                              available=avail, reason=why))
    for name in plugins:
        if name in KVACTORS_PLUGINS:
            dtype = KVACTORS_PLUGINS[name]
            if name == PLUGIN_CPU:
                flag = env.get("KVACTORS_LMCACHE_CPU", "").strip().lower()
                on = flag in ("1", "true", "yes", "on")
                avail, why = on, "" if on else "set KVACTORS_LMCACHE_CPU=1 to enable"
            else:
                p = probes[dtype]
                avail, why = p.available, p.reason
        else:
            dtype, avail, why = name, False, "a third-party plugin: not checked by kvactors"
        facts.append(SpecFact(backend=name, device_type=dtype, origin="plugin",
                              available=avail, reason=why))
    return facts


def collect(env: dict[str, str] | None = None) -> DoctorReport:
    """Gather the doctor report (``env`` defaults to ``os.environ``)."""
    import torch

    e = dict(os.environ if env is None else env)
    # str() the details: a probe may hand back e.g. a TorchVersion, which JSON cannot encode.
    probes = {
        p.backend: msgspec.structs.replace(p, details={k: str(v) for k, v in p.details.items()})
        for p in probe_all(BACKEND_KINDS)
    }
    plugins = _plugins()
    packages = {k: _version(v) for k, v in _VENDOR_DISTS.items()}
    try:
        adapter = importlib.util.find_spec("kvactors_lmcache") is not None
    except (ImportError, ValueError):
        adapter = False
    selection = predict_selection(_spec_facts(probes, plugins, e), e)
    report = DoctorReport(
        python=sys.version.split()[0],
        platform=platform.platform(),
        kvactors=_version(("kvactors",)) or "not installed (source tree)",
        packages=packages,
        torch_threads=torch.get_num_threads(),
        backends=list(probes.values()),
        plugins=plugins,
        adapter_importable=adapter,
        selection=selection,
        env={k: e[k] for k in ENV_VARS if k in e}
        | {k: v for k, v in e.items() if k.startswith("KVACTORS_")},
        findings=[],
    )
    return msgspec.structs.replace(report, findings=_findings(report, e))


def _findings(r: DoctorReport, env: dict[str, str]) -> list[Finding]:
    out: list[Finding] = []
    for p in r.backends:
        if p.available:
            out.append(Finding(level="ok", topic=f"backend {p.backend}", message="available"))
            continue
        fix = {
            "mlu": "install Cambricon's torch_mlu built for this torch and check `cnmon` "
            "sees a device (and MLU_VISIBLE_DEVICES)",
            "musa": "install Moore Threads' torch_musa built for this torch and check "
            "`mthreads-gmi` sees a device (and MUSA_VISIBLE_DEVICES)",
            "cuda": "needs an NVIDIA GPU and a CUDA build of torch (optional: tests only)",
        }.get(p.backend, "")
        sim = (
            " `kvactors demo --device " + p.backend + "` still runs on the fake module"
            if p.backend in ("mlu", "musa") else ""
        )
        out.append(Finding(level="info", topic=f"backend {p.backend}",
                           message=f"unavailable: {p.reason}.{sim}", fix=fix))
    lm = r.packages.get("lmcache")
    if lm is None:
        out.append(Finding(
            level="info", topic="lmcache",
            message="lmcache is not installed: kvactors works standalone; the LMCache plugin "
            "is inactive",
            fix=f"pip install lmcache=={_LMCACHE_TESTED} (the version the adapter targets)"))
    else:
        if lm != _LMCACHE_TESTED:
            out.append(Finding(
                level="warn", topic="lmcache",
                message=f"lmcache {lm} is installed; the adapter is written and tested against "
                f"{_LMCACHE_TESTED}", fix=f"pip install lmcache=={_LMCACHE_TESTED}"))
        missing = sorted(set(KVACTORS_PLUGINS) - set(r.plugins))
        if missing:
            out.append(Finding(
                level="warn", topic="plugins",
                message=f"kvactors' LMCache entry points are not registered: {missing}",
                fix="reinstall kvactors into this environment (pip install -e . from the "
                "repository, or the wheel) so its entry points are registered"))
        if not r.adapter_importable:
            out.append(Finding(
                level="warn", topic="plugins",
                message="the adapter package kvactors_lmcache cannot be found",
                fix="reinstall kvactors (the wheel ships adapters/kvactors_lmcache)"))
    s = r.selection
    if s.outcome == "error":
        out.append(Finding(level="error", topic="LMCache selection", message=s.error,
                           fix=_selection_fix(s, env)))
    elif lm is not None:
        who = f"{s.backend} (kvactors)" if s.kvactors else (s.backend or "StubCPUDevice")
        level: Literal["ok", "info"] = "ok" if s.kvactors else "info"
        out.append(Finding(level=level, topic="LMCache selection",
                           message=f"LMCache would select {who}: {s.reason}; MP transfer mode "
                           f"{s.transfer_mode} ({s.transfer_mode_reason})",
                           fix="" if s.kvactors else _not_kvactors_fix(r)))
    accel = [p.backend for p in r.backends if p.available and p.backend != "cpu"]
    if env.get("KVACTORS_LMCACHE_CPU", "").strip() == "1" and accel:
        out.append(Finding(
            level="warn", topic="KVACTORS_LMCACHE_CPU",
            message=f"KVACTORS_LMCACHE_CPU=1 on a host with {', '.join(accel)}: the CPU plugin "
            "wins LMCache's auto-detection (cpu comes first) and hijacks torch_dev",
            fix="unset KVACTORS_LMCACHE_CPU outside tests"))
    if r.torch_threads > 1 and "OMP_NUM_THREADS" not in env:
        out.append(Finding(
            level="info", topic="threads",
            message=f"torch uses {r.torch_threads} intra-op threads; on small shared hosts "
            "parallel copies stall when any other thread runs (docs/benchmarks.md)",
            fix="benchmarks pin 1 thread and report 2 threads separately"))
    return out


def _selection_fix(s: Selection, env: dict[str, str]) -> str:
    if "Multiple LMCache backends" in s.error and "musa" in s.error:
        return f"export LMCACHE_DEVICE_BACKEND={PLUGIN_MUSA} in every process (server and workers)"
    if "LMCACHE_DEVICE_BACKEND" in s.error:
        return ("fix or unset LMCACHE_DEVICE_BACKEND; run `kvactors doctor` in the same "
                "environment as the LMCache process")
    if "transfer mode" in s.error or "lmcache_driven" in s.error:
        return "export LMCACHE_MP_TRANSFER_MODE=engine_driven (or unset it)"
    return "set LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly"


def _not_kvactors_fix(r: DoctorReport) -> str:
    avail = {p.backend for p in r.backends if p.available}
    if "mlu" in avail:
        return f"export LMCACHE_DEVICE_BACKEND={PLUGIN_MLU}"
    if "musa" in avail:
        return f"export LMCACHE_DEVICE_BACKEND={PLUGIN_MUSA}"
    return ("no accelerator for kvactors here; for a CPU-only test of the plugin export "
            "KVACTORS_LMCACHE_CPU=1 (tests only)")


_MARK = {"ok": "[ ok ]", "info": "[info]", "warn": "[WARN]", "error": "[FAIL]"}


def format_doctor(r: DoctorReport) -> str:
    """The report as text: versions, backends, plugins, selection, env, findings."""
    lines = [
        f"kvactors {r.kvactors}  python {r.python}  {r.platform}",
        "packages: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in r.packages.items()),
        f"torch intra-op threads: {r.torch_threads}",
        "backends:",
    ]
    for p in r.backends:
        state = "available" if p.available else f"unavailable ({p.reason})"
        extra = ", ".join(f"{k}={v}" for k, v in sorted(p.details.items()))
        lines.append(f"  {p.backend:<5} {state}" + (f"  [{extra}]" if extra else ""))
    lines.append("LMCache plugins (entry points, group lmcache.device_plugins):")
    lines += [f"  {k} = {v}" for k, v in r.plugins.items()] or ["  (none registered)"]
    s = r.selection
    lines.append(
        "LMCache selection (predicted): "
        + (f"ERROR: {s.error}" if s.outcome == "error" else
           f"{s.backend or 'StubCPUDevice'} [{s.device_type}] - {s.reason}")
    )
    lines.append(f"  MP transfer mode: {s.transfer_mode} ({s.transfer_mode_reason})")
    lines.append("environment:")
    lines += [f"  {k}={v}" for k, v in r.env.items()] or ["  (none of the relevant variables set)"]
    lines.append("findings:")
    for f in r.findings:
        lines.append(f"  {_MARK.get(f.level, f.level)} {f.topic}: {f.message}")
        if f.fix:
            lines.append(f"         -> {f.fix}")
    return "\n".join(lines)
