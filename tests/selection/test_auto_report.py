"""The results block a build writes when it ships nothing says which choice a test member refused
and what ``policies/auto`` still holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture()
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    import auto_report

    yield auto_report
    sys.modules.pop("auto_report", None)


def _block(report, chosen, current):
    objective = {"a": -0.5, "b": -0.4}
    accept = {
        "a": {"m/clean": {"met": True}},
        "b": {"m/clean": {"met": False}},
    }
    verdicts = {"a": {"passed": False, "reasons": ["on test members: harms m/rl-finetune"]}}
    return report.not_built_block(
        objective, objective, accept, verdicts, ["a", "b"], objective, {"a": 0.4, "b": -0.3},
        chosen=chosen, current=current,
    )  # fmt: skip


def test_a_choice_refused_on_a_test_member_is_named_with_what_auto_still_is(report):
    head, _, _, _, row_a, row_b, torch = _block(report, "a", "a")
    assert "**This build ships nothing**: its choice on the validation members, `a`," in head
    assert "does harm on a test member" in head
    assert "`policies/auto` is still the last shipped build's `a`, the same candidate" in head
    assert row_a.startswith("| `a` | -0.5000 | -0.5000 | +0.4000 | on test members: harms")
    assert row_b.endswith("| m/clean |") and torch.startswith("| `torch` |")


def test_with_no_choice_and_nothing_shipped_it_says_to_keep_torch(report):
    head = _block(report, None, None)[0]
    assert "no candidate meets the bar" in head and "keep `torch` where losses spike" in head
    assert "policies/auto" not in head
