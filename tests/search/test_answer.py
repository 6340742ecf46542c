"""The end of a search in words: the table that keeps replay apart from real steps, the answer
lines and the manifest's evidence, measured against ``torch`` and ``auto``."""

from __future__ import annotations

import pytest

from autoscale.search.answer import answer_lines, evidence
from autoscale.search.candidates import Candidate
from autoscale.search.choose import Choice
from autoscale.search.objective import lead
from autoscale.search.report import comparison_table
from autoscale.search.validate import Validated
from autoscale.search.workload import base_spec
from autoscale.training.scorecard import Scorecard

SPEC = base_spec(model="mlp")


def card(skip_rate, precision, eval_loss, steps=64):
    return Scorecard(
        steps, round(skip_rate * steps), skip_rate, precision, eval_loss, eval_loss, eval_loss,
        2.0**16, False, False, 1.0, 64.0,
    )  # fmt: skip


def row(key, skip, precision, eval_loss, real=True):
    key = Candidate.parse(key)
    cards = [card(skip, precision, eval_loss), card(skip, precision, eval_loss)]
    return Validated(key, key.name, {"mlp/bad-batches": cards}, real)


def test_replay_rows_stand_apart_without_the_loss_replay_cannot_know():
    from autoscale.envs.suite import as_suite

    torch = row("rule:torch", 0.125, 0.3, 3.05)
    auto = row("policy:auto", 0.125, 0.01, 3.04)
    replayed = row("rule:amax-cap", 0.0, 0.0, 2.58, real=False)  # a loss from other steps
    text = comparison_table([auto, torch, replayed], torch, as_suite(SPEC), "policy:auto")
    real_part, replay_part = text.split("no time for real steps")
    assert "eval loss" in real_part and "* auto" in real_part and "amax-cap" not in real_part
    assert "3.04" in real_part  # a real row's loss is shown
    assert (
        "amax-cap" in replay_part and "eval loss" not in replay_part and "2.58" not in replay_part
    )
    assert "skip rate" in replay_part and "not ranked against the rows above" in replay_part
    assert "objective vs torch" not in replay_part


def test_the_answer_says_what_was_exported_why_and_how_it_compares_with_torch_and_auto():
    torch = row("rule:torch", 0.125, 0.3, 3.05)
    auto = row("policy:auto", 0.125, 0.01, 3.04)
    best = row("trial:4", 0.125, 0.0, 3.04)
    ld = lead(best.cards, auto.cards, torch.cards, SPEC.reward)
    assert ld.lead == pytest.approx(0.08) and ld.clear  # identical episodes: no spread
    choice = Choice(best, why="4 beat auto by 0.0800", bar=auto, leads={best.key: ld})
    lines = answer_lines("mine", "amax-loss (trial 4)", choice, best, torch, SPEC.reward, 96)
    assert lines[:2] == [
        "answer: exported 'mine' = amax-loss (trial 4)",
        "why: 4 beat auto by 0.0800",
    ]
    assert lines[2].startswith(
        "on your 2 held-out episodes of 96 real steps: exported: skipped 12.50%"
    )
    assert "torch: skipped 12.50%, precision loss 30.00%" in lines[2]
    assert (
        "auto: skipped 12.50%, precision loss 1.00%, eval loss 3.04, objective -2.3200" in lines[2]
    )
    t1, a1, b1 = (
        Validated(v.key, v.label, {m: cs[:1] for m, cs in v.cards.items()}, v.real)
        for v in (torch, auto, best)
    )
    ld1 = lead(b1.cards, a1.cards, t1.cards, SPEC.reward)
    one = Choice(b1, why=choice.why, bar=a1, leads={b1.key: ld1})
    single = answer_lines("mine", "amax-loss (trial 4)", one, b1, t1, SPEC.reward, 96)
    assert single[2].startswith("on your 1 held-out episode of 96 real steps: ")  # (the main job's)
    ev = evidence(choice, best, torch, SPEC.reward)
    assert ev["bar"] == "auto" and ev["why"] == choice.why
    assert set(ev["held_out"]) == {"exported", "torch", "auto"}
    assert ev["held_out"]["torch"]["objective"] == 0.0
    assert ev["leads_over_auto"]["trial:4"]["clear"] is True


def test_exporting_auto_itself_names_it_once():
    torch = row("rule:torch", 0.125, 0.3, 3.05)
    auto = row("policy:auto", 0.125, 0.01, 3.04)
    choice = Choice(auto, why="auto is the best found for this run: ...", bar=auto)
    lines = answer_lines(
        "mine", "auto, the shipped general policy", choice, auto, torch, SPEC.reward, 96
    )
    assert "exported (auto): skipped" in lines[2] and "; auto:" not in lines[2]
    assert "; torch: skipped 12.50%" in lines[2]


@pytest.mark.slow  # about a second or more
def test_the_final_table_ends_with_the_limit_and_each_real_rows_share(tmp_path):
    from autoscale.envs.limit import episodes_limit
    from autoscale.envs.suite import as_suite
    from autoscale.envs.traces import record_trace
    from autoscale.search.report import limit_block

    suite = as_suite(SPEC)
    member = suite.members[0]
    names = [i.name for i in member.instances["test"]]
    trace = record_trace(member, suite.episode.steps, tmp_path / "t.npz", instances=("test",))
    p_limit, _ = episodes_limit(trace, names, suite.episode.steps, member.episode)
    torch, auto = row("rule:torch", 0.125, 0.3, 3.05), row("policy:auto", 0.125, 0.01, 3.04)
    replayed = row("rule:amax-cap", 0.0, 0.0, 2.58, real=False)  # no real steps: no share
    lines = limit_block([auto, torch, replayed], {member.name: trace}, suite)
    assert lines[0].startswith(f"hindsight limit: precision loss {100 * p_limit:.2f}%")
    shares = {line.split()[0]: line.split()[1] for line in lines[2:]}
    assert shares == {"auto": f"{(0.3 - 0.01) / (0.3 - p_limit):.3f}"}
    assert limit_block([auto, torch], {}, suite) == []  # test steps not recorded: nothing to say
