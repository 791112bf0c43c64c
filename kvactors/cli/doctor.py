"""``kvactors doctor``: what can run here, what LMCache would select, and what to do about it.

kvactors never imports lmcache: when it is importable, the doctor runs LMCache's own detection
in a fresh subprocess with the same environment (``kvactors_lmcache/detect.py``) and reports
its answer. Everything else is read without side effects: package metadata, ``find_spec``, the
backends' probes and the command lines of this host's LMCache servers (``/proc/*/cmdline``,
for their ``--hash-algorithm``). When torch_mlu ships its CUDA-migration module
(``torch_mlu.utils.gpu_migration``, which makes ``torch.cuda`` answer for the MLU), LMCache is
asked a second time in a subprocess that imports it first.

Three stages: :func:`collect` gathers a frozen :class:`DoctorReport`, :func:`judge` runs the
small named rules of :data:`RULES` on it (each ``DoctorReport -> list[Finding]``), and
:func:`format_doctor` prints it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from kvactors.cli.torch_range import placement_line, torch_placement, torch_range_advice
from kvactors.core.plugins import PLUGIN_CPU
from kvactors.devices import BACKEND_KINDS, Probe, probe_all

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = (
    "BACKEND_ENV",
    "ENV_VARS",
    "LMCACHE_TESTED",
    "DoctorReport",
    "Finding",
    "RULES",
    "LMCacheServerProcess",
    "RegisteredBackend",
    "Rule",
    "Selection",
    "ask_lmcache",
    "backend_rule",
    "collect",
    "cpu_plugin_rule",
    "cuda_masquerades",
    "format_doctor",
    "hash_findings",
    "hash_rule",
    "judge",
    "lmcache_rule",
    "lmcache_servers",
    "migration_rule",
    "plugins_rule",
    "selection_rule",
    "threads_rule",
    "torch_rule",
)

BACKEND_ENV = "LMCACHE_DEVICE_BACKEND"
"""LMCache's variable that selects a device backend by name."""

ENV_VARS = (
    BACKEND_ENV,
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

LMCACHE_TESTED = ("0.5.6", "0.5.7rc2")
"""The LMCache versions the adapter is tested against (CI runs the adapter tests on each)."""

_VENDOR_DISTS = {
    "torch": ("torch",),
    "torch_mlu": ("torch_mlu", "torch-mlu"),
    "torch_musa": ("torch_musa", "torch-musa"),
    "lmcache": ("lmcache",),
}
_PLUGIN_GROUP = "lmcache.device_plugins"
_ADAPTER = "kvactors_lmcache"
_DETECT_TIMEOUT_S = 180.0
CUDA_MIGRATION_MODULE = "torch_mlu.utils.gpu_migration"
"""torch_mlu's CUDA-migration mode: importing it makes ``torch.cuda`` answer for the MLU."""
_SERVER_MODULES = ("lmcache.v1.multiprocess.server",)
_LMCACHE_DEFAULT_HASH = "blake3"  # the server's --hash-algorithm default (0.5.6, 0.5.7rc2)
_RESTART_SAFE_HASHES = ("blake3", "sha256_cbor", "sha256_cbor_64bit", "sha256")


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One observation: ``level`` is ``ok``, ``info``, ``warn`` or ``error``."""

    level: Literal["ok", "info", "warn", "error"]
    topic: str
    message: str
    fix: str = ""


class RegisteredBackend(msgspec.Struct, frozen=True, kw_only=True):
    """One backend in LMCache's registry, as LMCache itself reports it."""

    backend: str
    device_type: str
    origin: str
    """``builtin`` (shipped with LMCache) or ``plugin`` (an entry point)."""
    kvactors: bool
    available: bool | None
    """``is_available()`` here; ``None`` when it raised (``error``)."""
    spec: str = ""
    error: str = ""


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """LMCache's answer to "which device backend here", asked in a subprocess."""

    outcome: str
    """``selected``, ``stub`` (LMCache's StubCPUDevice), ``error`` (``import lmcache`` or the
    transfer-mode choice raises), ``absent`` (lmcache not installed) or ``unknown`` (the
    detection subprocess could not run)."""
    backend: str | None = None
    device_type: str = ""
    kvactors: bool = False
    """Whether the selected backend is one of kvactors' plugins."""
    error: str = ""
    transfer_mode: str = ""
    transfer_mode_reason: str = ""
    registry: list[RegisteredBackend] = msgspec.field(default_factory=list)
    source: str = ""
    """Where the answer came from (``LMCache 0.5.6 detection, in a subprocess``)."""


class LMCacheServerProcess(msgspec.Struct, frozen=True, kw_only=True):
    """An LMCache MP server running on this host, read from its command line."""

    pid: int
    hash_algorithm: str
    """``--hash-algorithm`` (LMCache's default when absent)."""
    l2_adapters: int
    """How many ``--l2-adapter`` it was given."""


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``kvactors doctor`` found."""

    python: str
    platform: str
    kvactors: str
    packages: dict[str, str | None]
    torch_threads: int
    torch: str
    """The running torch's ``__version__``."""
    torch_tested: str
    """The running torch against the tested range (``kvactors.cli.torch_range``): ``inside``,
    ``older``, ``newer`` or ``unknown``."""
    backends: list[Probe]
    plugins: dict[str, str]
    adapter_importable: bool
    selection: Selection
    env: dict[str, str]
    """The variables of :data:`ENV_VARS` and ``KVACTORS_*`` set where the report was taken
    (the rules read them here)."""
    findings: list[Finding]
    """What :data:`RULES` found (:func:`judge`)."""
    fake: str | None = None
    """The fake vendor module the report was taken under (``kvactors doctor --fake``)."""
    lmcache_servers: list[LMCacheServerProcess] = msgspec.field(default_factory=list)
    cuda_migration: str = "absent"
    """torch_mlu's CUDA migration: ``active`` (``torch.cuda`` is torch_mlu's in this process),
    ``available`` (the module is installed) or ``absent``."""
    selection_under_migration: Selection | None = None
    """LMCache's answer in a process that imported the migration module first."""

    @property
    def ok(self) -> bool:
        """No finding at level ``error``."""
        return all(f.level != "error" for f in self.findings)

    @property
    def kvactors_plugins(self) -> dict[str, str]:
        """kvactors' own entry points (``backend_name -> target``)."""
        return {k: v for k, v in self.plugins.items() if v.startswith(_ADAPTER + ".")}


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


def _detect_script() -> Path | None:
    """``kvactors_lmcache/detect.py``, located without importing the adapter (or lmcache)."""
    try:
        spec = importlib.util.find_spec(_ADAPTER)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "detect.py"
        if path.is_file():
            return path
    return None


def ask_lmcache(
    env: dict[str, str], *, fake: str | None = None, cuda_migration: bool = False
) -> Selection:
    """Run LMCache's own device detection in a fresh interpreter with ``env``; never raises.

    Args:
        env: The environment of the LMCache process to answer for.
        fake: ``"mlu"`` or ``"musa"``: answer as on a host with one such device
            (kvactors' fake vendor module is installed in the subprocess first).
        cuda_migration: import torch_mlu's CUDA-migration module before LMCache.
    """
    try:
        if importlib.util.find_spec("lmcache") is None:
            return Selection(outcome="absent", error="lmcache is not installed")
    except (ImportError, ValueError) as exc:
        return Selection(outcome="absent", error=f"lmcache cannot be found: {exc}")
    script = _detect_script()
    if script is None:
        return Selection(
            outcome="unknown", error=f"the adapter package {_ADAPTER} (detect.py) cannot be found"
        )
    cmd = [sys.executable, "-c", _run_detect(fake, cuda_migration=cuda_migration), str(script)]
    sub_env = {"LMCACHE_TRACK_USAGE": "false", **env}
    try:
        proc = subprocess.run(
            cmd, env=sub_env, capture_output=True, text=True, timeout=_DETECT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Selection(outcome="unknown", error=f"LMCache detection did not run: {exc}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Selection(
            outcome="unknown", error=f"LMCache detection exited {proc.returncode}: {tail[0]}"
        )
    try:
        raw = json.loads(lines[-1])
        registry = msgspec.convert(raw.get("registry", []), list[RegisteredBackend])
    except (ValueError, msgspec.ValidationError) as exc:
        return Selection(outcome="unknown", error=f"unreadable LMCache detection output: {exc}")
    mode = raw.get("transfer_mode") or {}
    error = str(raw.get("error") or "") or str(mode.get("error") or "")
    outcome = str(raw.get("outcome", "unknown"))
    return Selection(
        outcome="error" if error else outcome,
        backend=raw.get("backend"),
        device_type=str(raw.get("device_type") or ""),
        kvactors=bool(raw.get("kvactors")),
        error=error,
        transfer_mode=str(mode.get("mode") or ""),
        transfer_mode_reason=str(mode.get("reason") or ""),
        registry=registry,
        source=f"LMCache {raw.get('lmcache') or '?'} detection, in a subprocess",
    )


def _run_detect(fake: str | None, *, cuda_migration: bool) -> str:
    """The ``python -c`` code that runs ``detect.py`` (its path: ``sys.argv[1]``): after the
    CUDA-migration module's import with ``cuda_migration``, and inside kvactors' fake vendor
    module of ``fake`` when one is named (else nothing of kvactors is imported before lmcache,
    whose registry depends on what was imported first)."""
    lines = [f"import {CUDA_MIGRATION_MODULE}"] if cuda_migration else []
    lines += ["import runpy, sys", "sys.argv = sys.argv[1:]"]
    run = "runpy.run_path(sys.argv[0], run_name='__main__')"
    if fake is None:
        return "\n".join([*lines, run])
    return "\n".join(
        [
            *lines,
            "from kvactors.testing import fake_vendor",
            f"with fake_vendor({fake!r}):",
            f"    {run}",
        ]
    )


def lmcache_servers(proc: Path = Path("/proc")) -> list[LMCacheServerProcess]:
    """The LMCache MP servers running on this host (Linux ``/proc``; empty elsewhere)."""
    out: list[LMCacheServerProcess] = []
    with contextlib.suppress(OSError):
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # gone, or not ours to read
                continue
            words = [w.decode(errors="replace") for w in argv if w]
            if not any(m in words for m in _SERVER_MODULES):
                continue
            out.append(
                LMCacheServerProcess(
                    pid=int(entry.name),
                    hash_algorithm=_flag(words, "--hash-algorithm") or _LMCACHE_DEFAULT_HASH,
                    l2_adapters=sum(
                        1 for w in words if w == "--l2-adapter" or w.startswith("--l2-adapter=")
                    ),
                )
            )
    return sorted(out, key=lambda p: p.pid)


def _flag(words: list[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def hash_findings(servers: list[LMCacheServerProcess]) -> list[Finding]:
    """Whether each server's token hash survives a restart (what its L2 holds stays findable)."""
    out = []
    for srv in servers:
        where = f"LMCache server pid {srv.pid}"
        tier = f", {srv.l2_adapters} L2 adapter(s)" if srv.l2_adapters else ""
        if srv.hash_algorithm == "builtin":
            out.append(
                Finding(
                    level="warn",
                    topic="LMCache hash",
                    message=f"{where} runs --hash-algorithm builtin{tier}: Python's hash() differs "
                    "between processes, so after a restart it finds none of what its L2 holds",
                    fix="restart it with --hash-algorithm blake3 (LMCache's default; the "
                    "connector's lmcache.mp.hash_algorithm must name the same)",
                )
            )
        elif srv.hash_algorithm in _RESTART_SAFE_HASHES:
            out.append(
                Finding(
                    level="ok",
                    topic="LMCache hash",
                    message=f"{where} hashes with {srv.hash_algorithm}{tier}: the same after a "
                    "restart",
                )
            )
        else:
            out.append(
                Finding(
                    level="info",
                    topic="LMCache hash",
                    message=f"{where} hashes with {srv.hash_algorithm!r}{tier}, which the doctor "
                    "does not know; make sure it is the same in every process and after a restart",
                )
            )
    return out


def cuda_masquerades() -> bool:
    """Whether ``torch.cuda`` in this process is torch_mlu's (its CUDA-migration mode is on).

    Reads only what is already imported: never imports torch_mlu.
    """
    if CUDA_MIGRATION_MODULE in sys.modules:
        return True
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    for name in ("is_available", "current_device", "device_count"):
        owner = getattr(getattr(cuda, name, None), "__module__", "") or ""
        if owner.startswith("torch_mlu"):
            return True
    return False


def _migration_state() -> str:
    if cuda_masquerades():
        return "active"
    if "torch_mlu" not in sys.modules:  # find_spec of the submodule would import torch_mlu
        try:
            if importlib.util.find_spec("torch_mlu") is None:
                return "absent"
        except (ImportError, ValueError):
            return "absent"
    try:
        return "available" if importlib.util.find_spec(CUDA_MIGRATION_MODULE) else "absent"
    except (ImportError, ValueError):
        return "absent"


@contextlib.contextmanager
def _maybe_fake(kind: str | None) -> Iterator[None]:
    # kvactors.testing is imported only for --fake.
    if kind is None:
        yield
        return
    from kvactors.testing import fake_vendor

    with fake_vendor(kind):
        yield


def collect(env: dict[str, str] | None = None, *, fake: str | None = None) -> DoctorReport:
    """Gather the doctor report (``env`` defaults to ``os.environ``).

    Args:
        env: The environment to answer for (the LMCache detection subprocess gets exactly it).
        fake: ``"mlu"`` or ``"musa"``: answer as on a host with one such device, with
            kvactors' fake vendor module (``kvactors doctor --fake KIND``).
    """
    import torch

    e = dict(os.environ if env is None else env)
    with _maybe_fake(fake):
        # str() the details: a probe may hand back e.g. a TorchVersion, which JSON cannot encode.
        probes = {
            p.backend: msgspec.structs.replace(p, details={k: str(v) for k, v in p.details.items()})
            for p in probe_all(BACKEND_KINDS)
        }
    plugins = _plugins()
    packages = {k: _version(v) for k, v in _VENDOR_DISTS.items()}
    try:
        adapter = importlib.util.find_spec(_ADAPTER) is not None
    except (ImportError, ValueError):
        adapter = False
    report = DoctorReport(
        python=sys.version.split()[0],
        platform=platform.platform(),
        kvactors=_version(("kvactors",)) or "not installed (source tree)",
        packages=packages,
        torch_threads=torch.get_num_threads(),
        torch=str(torch.__version__),  # a TorchVersion, which JSON cannot encode
        torch_tested=torch_placement(torch.__version__),
        backends=list(probes.values()),
        plugins=plugins,
        adapter_importable=adapter,
        selection=ask_lmcache(e, fake=fake),
        env={k: e[k] for k in ENV_VARS if k in e}
        | {k: v for k, v in e.items() if k.startswith("KVACTORS_")},
        findings=[],
        fake=fake,
        lmcache_servers=lmcache_servers(),
    )
    migration = _migration_state()
    if migration != "absent" and packages.get("lmcache") is not None:
        report = msgspec.structs.replace(
            report,
            cuda_migration=migration,
            selection_under_migration=ask_lmcache(e, fake=fake, cuda_migration=True),
        )
    else:
        report = msgspec.structs.replace(report, cuda_migration=migration)
    return msgspec.structs.replace(report, findings=judge(report))


def _pick_lines(r: DoctorReport) -> list[str]:
    """``LMCACHE_DEVICE_BACKEND=<name>`` for each kvactors plugin whose device is here."""
    avail = {p.backend for p in r.backends if p.available}
    kv = [b for b in r.selection.registry if b.kvactors]
    if not kv:  # lmcache absent or unreadable: kvactors' own entry points
        kv = [
            RegisteredBackend(
                backend=n,
                device_type=n.removeprefix("kvactors_"),
                origin="plugin",
                kvactors=True,
                available=None,
            )
            for n in r.kvactors_plugins
        ]
    return [
        f"{BACKEND_ENV}={b.backend}"
        for b in kv
        if b.device_type != "cpu" and b.device_type in avail
    ]


def torch_rule(r: DoctorReport) -> list[Finding]:
    """The running torch against the tested range (and the vendor stacks built on it)."""
    level, message, fix = torch_range_advice(
        r.torch, {k: r.packages.get(k) for k in ("torch_mlu", "torch_musa")}
    )
    return [Finding(level=level, topic="torch", message=message, fix=fix)]


_BACKEND_FIX = {
    "mlu": "install Cambricon's torch_mlu built for this torch and check `cnmon` "
    "sees a device (and MLU_VISIBLE_DEVICES)",
    "musa": "install Moore Threads' torch_musa built for this torch and check "
    "`mthreads-gmi` sees a device (and MUSA_VISIBLE_DEVICES)",
    "cuda": "needs an NVIDIA GPU and a CUDA build of torch (optional: tests only)",
}


def backend_rule(r: DoctorReport) -> list[Finding]:
    """Each backend: available, or why not and what would make it so."""
    out = []
    for p in r.backends:
        topic = f"backend {p.backend}"
        if p.available:
            out.append(Finding(level="ok", topic=topic, message="available"))
            continue
        sim = (
            " `kvactors demo --device " + p.backend + "` still runs on the fake module"
            if p.backend in ("mlu", "musa")
            else ""
        )
        out.append(
            Finding(
                level="info",
                topic=topic,
                message=f"unavailable: {p.reason}.{sim}",
                fix=_BACKEND_FIX.get(p.backend, ""),
            )
        )
    return out


def lmcache_rule(r: DoctorReport) -> list[Finding]:
    """Whether lmcache is installed, and in a version the adapter is tested against."""
    lm = r.packages.get("lmcache")
    tested = " or ".join(LMCACHE_TESTED)
    if lm is None:
        return [
            Finding(
                level="info",
                topic="lmcache",
                message="lmcache is not installed: kvactors works standalone; the LMCache plugin "
                "is inactive",
                fix=f"install lmcache {tested} with scripts/install-lmcache.sh (see README)",
            )
        ]
    if lm in LMCACHE_TESTED:
        return []
    return [
        Finding(
            level="warn",
            topic="lmcache",
            message=f"lmcache {lm} is installed; the adapter is tested against {tested}",
            fix="LMCACHE_VERSION=0.5.6 scripts/install-lmcache.sh",
        )
    ]


def plugins_rule(r: DoctorReport) -> list[Finding]:
    """With lmcache installed: kvactors' entry points registered, its adapter package found."""
    if r.packages.get("lmcache") is None:
        return []
    out = []
    if not r.kvactors_plugins:
        out.append(
            Finding(
                level="warn",
                topic="plugins",
                message="kvactors' LMCache entry points are not registered",
                fix="reinstall kvactors into this environment (pip install -e . from the "
                "repository, or the wheel) so its entry points are registered",
            )
        )
    if not r.adapter_importable:
        out.append(
            Finding(
                level="warn",
                topic="plugins",
                message="the adapter package kvactors_lmcache cannot be found",
                fix="reinstall kvactors (the wheel ships adapters/kvactors_lmcache)",
            )
        )
    return out


def hash_rule(r: DoctorReport) -> list[Finding]:
    """Each LMCache server's hash (:func:`hash_findings`); with none running, what to pick."""
    out = hash_findings(r.lmcache_servers)
    if not r.lmcache_servers and r.packages.get("lmcache") is not None:
        out.append(
            Finding(
                level="info",
                topic="LMCache hash",
                message="no LMCache server runs on this host, so its --hash-algorithm is not "
                "checked",
                fix="start it with --hash-algorithm blake3 (never builtin: a restarted server "
                "would find none of what its L2 holds)",
            )
        )
    return out


def cpu_plugin_rule(r: DoctorReport) -> list[Finding]:
    """``KVACTORS_LMCACHE_CPU=1`` on a host with an accelerator: the CPU plugin wins."""
    accel = [p.backend for p in r.backends if p.available and p.backend != "cpu"]
    if r.env.get("KVACTORS_LMCACHE_CPU", "").strip() != "1" or not accel:
        return []
    return [
        Finding(
            level="warn",
            topic="KVACTORS_LMCACHE_CPU",
            message=f"KVACTORS_LMCACHE_CPU=1 on a host with {', '.join(accel)}: the CPU plugin "
            "wins LMCache's auto-detection (cpu comes first) and hijacks torch_dev",
            fix="unset KVACTORS_LMCACHE_CPU outside tests",
        )
    ]


def threads_rule(r: DoctorReport) -> list[Finding]:
    """More than one torch intra-op thread with ``OMP_NUM_THREADS`` unset."""
    if r.torch_threads <= 1 or "OMP_NUM_THREADS" in r.env:
        return []
    return [
        Finding(
            level="info",
            topic="threads",
            message=f"torch uses {r.torch_threads} intra-op threads; on small shared hosts "
            "parallel copies stall when any other thread runs",
            fix="benchmarks pin 1 thread and report 2 threads separately",
        )
    ]


def selection_rule(r: DoctorReport) -> list[Finding]:
    """What LMCache selects here (asked in a subprocess), and how to make it kvactors."""
    s = r.selection
    if s.outcome == "absent":
        return []
    picks = _pick_lines(r)
    how = (
        "to use kvactors: "
        + " or ".join(f"export {p}" for p in picks)
        + " in every LMCache worker process"
        if picks
        else "no device for kvactors here; for a CPU-only test of the plugin export "
        "KVACTORS_LMCACHE_CPU=1 (tests only)"
    )
    if s.outcome == "unknown":
        return [
            Finding(
                level="warn",
                topic="LMCache selection",
                message=f"could not ask LMCache: {s.error}",
                fix=how,
            )
        ]
    if s.outcome == "error":
        if "Multiple LMCache backends" in s.error:
            fix = f"choose one: export {BACKEND_ENV}=<backend_name> in every process; " + how
        elif BACKEND_ENV in s.error:
            named = r.env.get(BACKEND_ENV, "").strip().lower()
            probe = next((b for b in r.selection.registry if b.backend == named), None)
            dev = next((p for p in r.backends if probe and p.backend == probe.device_type), None)
            why = f" ({dev.reason})" if dev is not None and not dev.available else ""
            fix = f"fix the device{why} or unset {BACKEND_ENV}; " + how
        elif "transfer mode" in s.error or "lmcache_driven" in s.error:
            fix = "export LMCACHE_MP_TRANSFER_MODE=engine_driven (or unset it)"
        else:
            fix = how
        return [Finding(level="error", topic="LMCache selection", message=s.error, fix=fix)]
    who = f"{s.backend} (kvactors)" if s.kvactors else (s.backend or "StubCPUDevice")
    return [
        Finding(
            level="ok" if s.kvactors else "info",
            topic="LMCache selection",
            message=f"LMCache selects {who} for device type {s.device_type!r}; MP transfer mode "
            f"{s.transfer_mode} ({s.transfer_mode_reason})",
            fix="" if s.kvactors else how,
        )
    ]


def migration_rule(r: DoctorReport) -> list[Finding]:
    """What LMCache selects under torch_mlu's CUDA migration, and whether that is kvactors."""
    s = r.selection_under_migration
    if r.cuda_migration == "absent":
        return []
    state = (
        "is active in this process (torch.cuda is torch_mlu's)"
        if r.cuda_migration == "active"
        else f"is installed ({CUDA_MIGRATION_MODULE}; a worker that imports it has a torch.cuda "
        "that answers for the MLU)"
    )
    if s is None or s.outcome in ("unknown", "error", "absent"):
        why = s.error if s is not None else "not asked"
        return [
            Finding(
                level="warn",
                topic="CUDA migration",
                message=f"torch_mlu's CUDA migration {state}; LMCache could not be asked under it: "
                f"{why}",
                fix=f"export {BACKEND_ENV}=kvactors_mlu in every LMCache worker process",
            )
        ]
    who = s.backend or "StubCPUDevice"
    if s.kvactors:
        return [
            Finding(
                level="ok",
                topic="CUDA migration",
                message=f"torch_mlu's CUDA migration {state}; under it LMCache selects {who} "
                f"(kvactors) for device type {s.device_type!r}",
            )
        ]
    return [
        Finding(
            level="warn",
            topic="CUDA migration",
            message=f"torch_mlu's CUDA migration {state}; under it LMCache selects {who} for "
            f"device type {s.device_type!r}, not kvactors",
            fix=f"export {BACKEND_ENV}=kvactors_mlu in every LMCache worker process (LMCache then "
            "takes the MLU plugin whatever torch.cuda claims)",
        )
    ]


Rule = Callable[[DoctorReport], list[Finding]]
"""One judgement of a report: the findings it adds (none when it has nothing to say)."""

RULES: tuple[Rule, ...] = (
    torch_rule,
    backend_rule,
    lmcache_rule,
    plugins_rule,
    selection_rule,
    migration_rule,
    hash_rule,
    cpu_plugin_rule,
    threads_rule,
)
"""The doctor's rules, in the order their findings are printed."""


def judge(r: DoctorReport) -> list[Finding]:
    """Every rule's findings on ``r`` (its ``findings`` field is not read), in rule order.

    The rules read the environment the report was taken in from ``r.env``."""
    return [f for rule in RULES for f in rule(r)]


_MARK = {"ok": "[ ok ]", "info": "[info]", "warn": "[WARN]", "error": "[FAIL]"}


def format_doctor(r: DoctorReport) -> str:
    """The report as text: versions, backends, plugins, selection, env, findings."""
    lines = [
        f"kvactors {r.kvactors}  python {r.python}  {r.platform}"
        + (f"  [fake {r.fake} vendor module]" if r.fake else ""),
        "packages: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in r.packages.items()),
        placement_line(r.torch, r.torch_tested),
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
    head = f"LMCache selection ({s.source or 'not asked'}): "
    if s.outcome == "selected" or s.outcome == "stub":
        lines.append(
            head
            + f"{s.backend or 'StubCPUDevice'} [{s.device_type}]"
            + (" (kvactors)" if s.kvactors else "")
        )
        lines.append(f"  MP transfer mode: {s.transfer_mode} ({s.transfer_mode_reason})")
    elif s.outcome == "absent":
        lines.append(head + "lmcache is not installed")
    else:
        lines.append(head + f"{s.outcome.upper()}: {s.error}")
    for b in s.registry:
        state = {True: "available", False: "unavailable", None: f"raised {b.error}"}[b.available]
        lines.append(
            f"  {b.backend:<14} [{b.device_type}] {b.origin:<7} {state}"
            + ("  (kvactors)" if b.kvactors else "")
        )
    picks = _pick_lines(r)
    kv_names = sorted(r.kvactors_plugins)
    lines.append(
        "select kvactors: "
        + (
            ", ".join(f"{BACKEND_ENV}={n}" for n in kv_names if n != PLUGIN_CPU)
            + "; CPU tests: KVACTORS_LMCACHE_CPU=1"
            + (f"  (here: {' or '.join(picks)})" if picks else "")
        )
    )
    if r.selection_under_migration is not None:
        m = r.selection_under_migration
        lines.append(
            f"LMCache selection under torch_mlu's CUDA migration ({r.cuda_migration}): "
            + (
                f"{m.backend or 'StubCPUDevice'} [{m.device_type}]"
                + (" (kvactors)" if m.kvactors else "")
                if m.outcome in ("selected", "stub")
                else f"{m.outcome.upper()}: {m.error}"
            )
        )
    for srv in r.lmcache_servers:
        lines.append(
            f"LMCache server pid {srv.pid}: --hash-algorithm {srv.hash_algorithm}, "
            f"{srv.l2_adapters} L2 adapter(s)"
        )
    lines.append("environment:")
    lines += [f"  {k}={v}" for k, v in r.env.items()] or ["  (none of the relevant variables set)"]
    lines.append("findings:")
    for f in r.findings:
        lines.append(f"  {_MARK.get(f.level, f.level)} {f.topic}: {f.message}")
        if f.fix:
            lines.append(f"         -> {f.fix}")
    return "\n".join(lines)
