"""A candidate of a search, one type: a built-in rule, a shipped policy or a trial, stored as the
study's key."""

from __future__ import annotations

import json

import pytest

from autoscale.search.candidates import AUTO, TORCH, Candidate


def test_rules_and_trials_read_their_parts_and_stay_the_stored_key():
    rule, trial = Candidate.rule("amax-loss"), Candidate.trial(12)
    assert (rule.kind, rule.name, rule.is_rule, rule.is_trial) == ("rule", "amax-loss", True, False)
    assert (trial.kind, trial.number, trial.is_trial) == ("trial", 12, True)
    assert TORCH == "rule:torch" and trial == "trial:12"  # the key the study stores
    assert json.loads(json.dumps({trial: 1})) == {"trial:12": 1}
    assert {TORCH: 1}["rule:torch"] == 1  # a plain key finds it and the other way round
    assert Candidate.parse("trial:12") == trial and Candidate.parse("rule:torch") == TORCH
    with pytest.raises(ValueError, match="not a trial"):
        _ = rule.number


def test_auto_is_a_shipped_policy_named_like_a_rule_but_of_its_own_kind():
    assert AUTO == "policy:auto" and Candidate.parse("policy:auto") == AUTO
    assert (AUTO.kind, AUTO.name, AUTO.is_policy, AUTO.is_rule, AUTO.is_named) == (
        "policy", "auto", True, False, True,
    )  # fmt: skip
    assert TORCH.is_named and not Candidate.trial(3).is_named


@pytest.mark.parametrize("key", ["torch", "trial:x", "rule:", "policy:", "auto", ""])
def test_anything_else_is_refused(key):
    with pytest.raises(ValueError, match="not a candidate"):
        Candidate.parse(key)
