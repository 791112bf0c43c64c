"""The doctor's rules, one by one, on reports built here (no host, no subprocess).

Every rule in :data:`kvactors.cli.doctor.RULES` has a trigger below: on a clean report it says
nothing but ``ok``; on the clean report changed by its trigger it adds a finding of its topic
at a level above ``ok``, and :func:`judge` (what ``kvactors doctor`` prints) carries that
finding. A rule dropped from ``RULES`` fails the walk (its finding is missing from the judged
report), and a rule added to ``RULES`` without a trigger here fails it too.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvactors.cli import doctor
from kvactors.cli.doctor import (
    RULES,
    DoctorReport,
    LMCacheServerProcess,
    RegisteredBackend,
    Rule,
    Selection,
    judge,
)
from kvactors.cli.torch_range import TORCH_TESTED
from kvactors.devices import Probe

_KV_MLU = RegisteredBackend(
    backend="kvactors_mlu", device_type="mlu", origin="plugin", kvactors=True, available=True
)


def _clean() -> DoctorReport:
    """A host where everything is as it should be: MLU up, LMCache selects kvactors."""
    lo = TORCH_TESTED[0]
    return DoctorReport(
        python="3.12.0",
        platform="Linux",
        kvactors="0.0.0",
        packages={"torch": "x", "torch_mlu": None, "torch_musa": None, "lmcache": "0.5.6"},
        torch_threads=1,
        torch=f"{lo[0]}.{lo[1]}.0",
        torch_tested="inside",
        backends=[Probe(backend="cpu", available=True), Probe(backend="mlu", available=True)],
        plugins={"kvactors_mlu": "kvactors_lmcache.plugins:MluSpec"},
        adapter_importable=True,
        selection=Selection(
            outcome="selected",
            backend="kvactors_mlu",
            device_type="mlu",
            kvactors=True,
            transfer_mode="engine_driven",
            transfer_mode_reason="auto",
            registry=[_KV_MLU],
        ),
        env={},
        findings=[],
        lmcache_servers=[LMCacheServerProcess(pid=7, hash_algorithm="blake3", l2_adapters=1)],
    )


def _unavailable_musa(r: DoctorReport) -> dict[str, Any]:
    return {"backends": [*r.backends, Probe(backend="musa", available=False, reason="absent")]}


# rule -> (what turns the clean report into one the rule speaks up about, the finding's topic)
TRIGGERS: dict[Rule, tuple[Any, str]] = {
    doctor.torch_rule: (lambda r: {"torch": "1.9.0"}, "torch"),
    doctor.backend_rule: (_unavailable_musa, "backend musa"),
    doctor.lmcache_rule: (lambda r: {"packages": {**r.packages, "lmcache": "0.4.0"}}, "lmcache"),
    doctor.plugins_rule: (lambda r: {"plugins": {}, "adapter_importable": False}, "plugins"),
    doctor.selection_rule: (
        lambda r: {"selection": Selection(outcome="error", error="Multiple LMCache backends")},
        "LMCache selection",
    ),
    doctor.migration_rule: (
        lambda r: {
            "cuda_migration": "available",
            "selection_under_migration": Selection(
                outcome="selected", backend="cuda", device_type="cuda"
            ),
        },
        "CUDA migration",
    ),
    doctor.hash_rule: (
        lambda r: {
            "lmcache_servers": [
                LMCacheServerProcess(pid=8, hash_algorithm="builtin", l2_adapters=1)
            ]
        },
        "LMCache hash",
    ),
    doctor.cpu_plugin_rule: (
        lambda r: {"env": {"KVACTORS_LMCACHE_CPU": "1"}},
        "KVACTORS_LMCACHE_CPU",
    ),
    doctor.threads_rule: (lambda r: {"torch_threads": 4}, "threads"),
}


def test_every_rule_in_the_tuple_has_a_trigger_here() -> None:
    assert len(set(RULES)) == len(RULES), "a rule is listed twice"
    assert set(RULES) == set(TRIGGERS), "RULES and this test's triggers name different rules"


def test_a_clean_report_has_nothing_to_fix() -> None:
    findings = judge(_clean())
    assert findings
    assert {f.level for f in findings} == {"ok"}, findings


@pytest.mark.parametrize("rule", list(TRIGGERS), ids=lambda rule: rule.__name__)
def test_each_rule_speaks_up_on_its_trigger_and_the_doctor_reports_it(rule: Rule) -> None:
    clean = _clean()
    assert all(f.level == "ok" for f in rule(clean)), rule(clean)
    change, topic = TRIGGERS[rule]
    report = msgspec.structs.replace(clean, **change(clean))
    fired = [f for f in rule(report) if f.level != "ok"]
    assert fired, f"{rule.__name__} said nothing about its trigger"
    assert {f.topic for f in fired} == {topic}
    judged = judge(report)
    for f in fired:
        assert f in judged, f"{rule.__name__}'s finding is not in the doctor's report"


def test_the_findings_come_in_rule_order() -> None:
    report = _clean()
    for change, _ in TRIGGERS.values():
        report = msgspec.structs.replace(report, **change(report))
    assert judge(report) == [f for rule in RULES for f in rule(report)]
    topics = [f.topic for f in judge(report) if f.level != "ok"]
    assert topics[0] == "torch"
    assert topics[-1] == "threads"
