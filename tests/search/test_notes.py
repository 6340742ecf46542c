import math
import xml.etree.ElementTree as ET

from autoscale.envs.spec import RewardWeights
from autoscale.scalers.controller import StepStats
from autoscale.search.plots import trajectory_svg
from autoscale.search.trials import report_points, trial_note
from autoscale.training.records import StepRecord
from autoscale.training.scorecard import Scorecard

W = RewardWeights()


def card(skip_rate, precision, diverged=False):
    return Scorecard(
        32,
        round(32 * skip_rate),
        skip_rate,
        precision,
        3.0,
        3.1,
        1.0,
        2.0**16,
        False,
        diverged,
        0.0,
        math.nan,
    )


def test_note_compares_with_torch_per_member_and_names_the_worst():
    # member a: policy costs 0.0625+0.004 = 0.0665, torch 0.125+0.012 = 0.137 -> regret -0.0705
    # member b: policy 0.125+0.008 = 0.133, torch 0.25+0.004 = 0.254 -> regret -0.121
    # objective = mean(-0.0705, -0.121) + max = -0.09575 - 0.0705 = -0.16625 (-0.1663 printed)
    cards = {"a": [card(0.0625, 0.001)], "b": [card(0.125, 0.002)]}
    ref = {"a": [card(0.125, 0.003)], "b": [card(0.25, 0.001)], "c": [card(0.0, 0.0)]}
    note = trial_note(
        "Trial 7: deepspeed",
        "deepspeed(hysteresis=1)",
        cards,
        ref,
        W,
        total=2,
        test_objective=0.1,
    )
    assert note.startswith("### Trial 7: deepspeed\n`deepspeed(hysteresis=1)`")
    assert "**objective -0.1663** on 2 train episodes (replay; 0 = `torch`" in note
    assert "mean regret -0.0958, worst -0.0705 on `a`" in note
    assert "It skipped 9.38% of steps (torch: 18.75%)" in note and "lost precision on 0.15%" in note
    assert "| a | 6.25% | 0.10% | 12.50% | 0.30% | -0.0705 |" in note
    assert "| c |" not in note  # only the members the trial ran
    assert "objective +0.1000." in note


def test_note_says_why_a_trial_stopped_early():
    ref = {"a": [card(0.0, 0.0), card(0.0, 0.0)], "b": [card(0.0, 0.0)]}
    pruned = trial_note("T", "p", {"a": [card(0.0, 0.05)]}, ref, W, total=3)
    assert "on 1 of 3 train episodes" in pruned and "Pruned after 1 of 3 episodes" in pruned
    diverged = trial_note(
        "T",
        "p",
        {"a": [card(0.0, 0.0), card(0.0, 0.0)], "b": [card(0.0, 0.0, diverged=True)]},
        ref,
        W,
        total=3,
    )
    assert "Training diverged on b" in diverged and "Pruned" not in diverged


def test_report_points_keep_reports_few():
    assert report_points(1) == set() and report_points(3) == {1, 2} and report_points(4) == {1, 3}
    assert report_points(12) == {4, 8} and report_points(48) == {16, 32}


def test_trajectory_svg_is_well_formed_with_one_panel_per_episode_and_skips_marked():
    def rec(i, scale, skipped):
        stats = StepStats(i, scale, skipped, math.inf if skipped else 1.0, 1.0, 3.0, True)
        return StepRecord(i, scale, skipped, 3.0, False, 1.0, 1.0, 0.0, 1e-3, 0.0, stats)

    a = [rec(i, 2.0 ** (16 - (i > 4)), i == 4) for i in range(8)]
    b = [rec(i, 2.0**12, False) for i in range(8)]
    svg = trajectory_svg([("a", a, [15.5] * 8), ("b & c", b, None)], "trial 1: torch(x<2)")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == 3  # two scale trajectories, one threshold
    assert len(root.findall(f"{ns}path")) == 1  # the one skipped step
    texts = [t.text for t in root.findall(f"{ns}text")]
    assert "trial 1: torch(x<2)" in texts and "b & c" in texts


def test_long_episodes_are_drawn_with_few_points():
    def rec(i, scale, skipped):
        stats = StepStats(i, scale, skipped, math.inf if skipped else 1.0, 1.0, 3.0, True)
        return StepRecord(i, scale, skipped, 3.0, False, 1.0, 1.0, 0.0, 1e-3, 0.0, stats)

    n = 4096
    recs = [rec(i, 2.0 ** (16 - (i // 1000)), i % 500 == 499) for i in range(n)]
    svg = trajectory_svg([("long", recs, [15.5 + (i % 7) / 7 for i in range(n)])], "t")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    scale_line, threshold = None, None
    for line in root.findall(f"{ns}polyline"):
        if "dasharray" in line.get("stroke-dasharray", "") or line.get("stroke-dasharray"):
            threshold = line
        else:
            scale_line = line
    assert len(scale_line.get("points").split()) <= 2 * 5 + 1  # only where the scale changes
    assert len(threshold.get("points").split()) <= 300
    assert len(root.findall(f"{ns}path")) == 8  # one mark per bin holding a skip
    assert len(svg) < 20_000
