"""The bar, "no worse than torch": one definition for the search's no-harm check and the `auto`
build, and the rule that picks what ships."""

from __future__ import annotations

import math

import pytest

from autoscale.training import TrainingRun
from autoscale.training.bar import (
    NOISE_FLOOR,
    SKIP_POINTS,
    acceptance,
    first_passing,
    harm,
    missed_on_loss_alone,
    paired_difference,
    seed_noise,
)
from autoscale.training.scorecard import Scorecard
from autoscale.training.spec import WorkloadSpec


def card(skip=0.01, loss=2.0, prec=0.0, diverged=False) -> Scorecard:
    return Scorecard(
        steps=1000, skipped=int(skip * 1000), skip_rate=skip, precision_loss=prec,
        final_loss=loss, eval_loss=loss, min_scale=1.0, max_scale=2.0**16, hit_min=False,
        diverged=diverged, wall_s=1.0, useful_steps_per_s=100.0,
    )  # fmt: skip


def test_harm_names_each_way_a_long_run_is_worse_and_nothing_else():
    ref = card()
    assert harm(card(), ref, noise=0.01) == []
    assert harm(card(skip=0.01 + SKIP_POINTS), ref) == []  # at the allowance: no harm
    (why,) = harm(card(skip=0.02), ref, steps=1000)
    assert why.startswith("skipped 2.00% of 1000 steps, torch 1.00%")
    assert harm(card(loss=2.009), ref, noise=0.01) == []  # within the seed noise
    (why,) = harm(card(loss=2.02), ref, noise=0.01)
    assert why == "final eval loss 2.02, torch 2 (seed noise 0.01)"
    # no noise measured: the floor still forgives rounding-level differences
    assert harm(card(loss=2.0 * (1 + NOISE_FLOOR / 2)), ref) == []
    assert harm(card(loss=math.nan), ref)  # a NaN eval loss is worse
    assert harm(card(diverged=True), ref) and not harm(card(diverged=True), card(diverged=True))
    assert harm(card(), ref, kept=0.908, kept_ref=0.91) == []  # kept share within 0.5 points
    (why,) = harm(card(), ref, kept=0.90, kept_ref=0.95)
    assert why.startswith("keeps 90.00% of gradient elements")


def test_seed_noise_is_the_spread_with_a_floor():
    assert seed_noise([2.0, 2.1, 1.9]) == pytest.approx(0.2)
    assert seed_noise([2.0, 2.0]) == pytest.approx(NOISE_FLOOR * 2.0)


def test_a_seed_whose_eval_loss_overflowed_neither_forgives_nor_refuses_every_loss():
    """An inf among torch's eval losses made the noise inf (a candidate ending at 50 against
    torch's 2.0 passed); a NaN made it NaN or not by its place in the list."""
    assert seed_noise([2.0, math.inf]) == pytest.approx(NOISE_FLOOR * 2.0)
    assert seed_noise([math.nan, 2.0, 2.1]) == seed_noise([2.0, 2.1, math.nan])
    assert seed_noise([2.0, 2.1, math.nan]) == pytest.approx(0.1)
    assert seed_noise([math.nan, math.inf]) == 0.0
    assert harm(card(loss=50.0), card(), noise=seed_noise([2.0, math.inf]))
    # torch's own run on this seed ended at a non-finite loss: a finite one is not worse
    assert harm(card(loss=2.5), card(loss=math.nan)) == []
    assert harm(card(loss=2.5), card(loss=math.inf)) == []


def test_acceptance_screens_on_three_episodes_and_confirms_on_pairs():
    ref = [card(loss=x) for x in (2.0, 2.1, 1.9)]
    row = acceptance([card(loss=x) for x in (2.1, 2.2, 2.0)], ref)  # +0.1 within a 0.2 spread
    assert row["met"] and row["values"]["noise"] == pytest.approx(0.2)
    row = acceptance([card(loss=x) for x in (2.3, 2.4, 2.2)], ref)
    assert not row["loss"] and row["skip"] and row["precision"] and missed_on_loss_alone(row)
    # more paired episodes: a steady +0.05 with little scatter is beyond 2 standard errors
    mine = [card(loss=2.0 + 0.05 + 0.001 * (k % 3)) for k in range(12)]
    pairs = [card(loss=2.0) for _ in range(12)]
    row = acceptance(mine, pairs, paired=True)
    assert not row["met"] and not missed_on_loss_alone(row)
    assert row["values"]["paired"]["episodes"] == 12
    diff, err = paired_difference(mine, pairs)
    assert diff == pytest.approx(0.051) and err < 0.001
    # precision counts only where torch underflows (loses precision on more than 1%)
    assert acceptance([card(prec=0.005)], [card(prec=0.001)])["precision"]
    assert not acceptance([card(prec=0.05)], [card(prec=0.04)])["precision"]


def test_first_passing_picks_the_first_that_passes_every_stage_in_order():
    ran: list[tuple[str, str]] = []

    def stage(name, fails):
        def judge(c):
            ran.append((name, c))
            return [f"{name} fails {c}"] if c in fails else []

        return judge

    stages = [stage("bar", {"a"}), stage("check", {"b"}), stage("long", set())]
    pick, why = first_passing(["a", "b", "c", "d"], stages)
    assert pick == "c"
    assert why == {"a": ["bar fails a"], "b": ["check fails b"], "c": []}
    # a stage runs only after the ones before it passed; nothing after the pick runs
    assert ran == [("bar", "a"), ("bar", "b"), ("check", "b"), ("bar", "c"), ("check", "c"),
                   ("long", "c")]  # fmt: skip
    assert first_passing(["a"], stages) == (None, {"a": ["bar fails a"]})


@pytest.mark.slow
def test_harm_on_real_long_runs():
    """Real runs: torch against itself on the same seed does no harm; a static scale of 2^-10
    (every fp16 gradient flushed) on the same run does."""
    import autoscale

    spec = WorkloadSpec(model="mlp", scenario="clean")
    cards = {}
    for name, kw in (("torch", {}), ("again", {}), ("low", {"init_scale": 2.0**-10})):
        rule = "static" if name == "low" else "torch"
        cards[name] = TrainingRun(spec, autoscale.get_scaler(rule, device="cpu", **kw)).run(200)
    assert harm(cards["again"], cards["torch"]) == []
    assert harm(cards["low"], cards["torch"]), cards
