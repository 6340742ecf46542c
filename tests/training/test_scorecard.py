"""The scorecard's definitions, on hand-built records."""

import json
import math

import pytest

from autoscale.errors import ConfigError
from autoscale.scalers import StepStats
from autoscale.training import (
    HIST_EDGES,
    Scorecard,
    StepRecord,
    precision_loss_from_hist,
    step_metrics,
    summarize,
)
from autoscale.training.scorecard import json_safe, precision_loss_from_counts


def rec(step, scale, found_inf=False, loss=1.0, precision=0.0, backward_amax=None):
    stats = StepStats(step, scale, found_inf, math.nan if found_inf else 0.5, 0.1, loss)
    return StepRecord(
        step, scale, found_inf, loss, not math.isfinite(loss), stats.grad_amax, 0.1,
        math.nan if found_inf else precision, 1e-3, 0.01, stats, None, backward_amax,
    )  # fmt: skip


def test_from_records_hand_computed():
    records = [rec(i, 2.0**16, loss=10.0 - i, precision=0.1) for i in range(18)]
    records[3] = rec(3, 2.0**15, found_inf=True, loss=math.inf)
    records[17] = rec(17, 2.0**10, found_inf=True, loss=math.nan)
    records[16] = rec(
        16, 2.0**17, loss=math.inf, precision=0.4
    )  # applied, but its loss is not finite
    card = Scorecard.from_records(records, eval_loss=2.5, hit_min=True, wall_s=4.0)
    assert card.steps == 18 and card.skipped == 2
    assert card.skip_rate == pytest.approx(2 / 18)
    assert card.precision_loss == pytest.approx((15 * 0.1 + 0.4) / 16)
    # last max(1, 18 // 10) = 1 applied step is step 16, whose loss is inf: no finite loss
    assert math.isnan(card.final_loss)
    assert (card.min_scale, card.max_scale) == (2.0**10, 2.0**17)
    assert card.hit_min and not card.diverged
    assert card.useful_steps_per_s == pytest.approx(16 / 4.0)
    assert card.eval_loss == 2.5


def test_final_loss_averages_the_tail_of_applied_steps():
    records = [rec(i, 8.0, loss=float(i)) for i in range(30)]
    records[29] = rec(29, 8.0, found_inf=True, loss=math.inf)
    card = Scorecard.from_records(records, eval_loss=1.0, hit_min=False, wall_s=1.0)
    assert card.final_loss == pytest.approx((26 + 27 + 28) / 3)  # last 3 applied steps


def test_diverged_and_json():
    card = Scorecard.from_records([rec(0, 4.0)], eval_loss=math.nan, hit_min=False, wall_s=0.5)
    assert card.diverged
    assert Scorecard.from_records(
        [rec(0, 4.0)], eval_loss=1.0, hit_min=False, wall_s=0.5, params_finite=False
    ).diverged
    text = card.to_json()
    d = json.loads(text)
    assert d["eval_loss"] is None and "NaN" not in text
    assert set(d) == {
        "steps", "skipped", "skip_rate", "precision_loss", "final_loss", "eval_loss", "min_scale",
        "max_scale", "hit_min", "diverged", "wall_s", "useful_steps_per_s",
    }  # fmt: skip
    back = Scorecard.from_dict(d)
    assert back.steps == 1 and math.isnan(back.eval_loss) and back.diverged


def test_empty_records_refused():
    with pytest.raises(ConfigError, match="at least one step"):
        Scorecard.from_records([], eval_loss=1.0, hit_min=False, wall_s=1.0)


def test_precision_from_counts():
    assert precision_loss_from_counts(25.0, 100.0, False) == 0.25
    assert math.isnan(precision_loss_from_counts(25.0, 100.0, True))
    assert precision_loss_from_counts(0.0, 0.0, False) == 0.0


def test_precision_from_hist():
    assert len(HIST_EDGES) == 81 and HIST_EDGES[0] == -64.0 and HIST_EDGES[-1] == 16.0
    hist = [0.0] * 80
    hist[-30 + 64] = 0.5  # elements with log2|g| in [-30, -29)
    hist[-20 + 64] = 0.5  # in [-20, -19)
    # lost when log2|g| + log2_scale < -14
    assert precision_loss_from_hist(hist, 16.0) == 0.0  # -30 + 16 = -14: not below
    assert precision_loss_from_hist(hist, 15.0) == 0.5
    assert precision_loss_from_hist(hist, 5.0) == 1.0
    assert precision_loss_from_hist(hist, 15.5) == pytest.approx(0.25)  # half of the bin [-30, -29)
    assert (
        precision_loss_from_hist(hist, 100.0) == 0.0
        and precision_loss_from_hist(hist, -100.0) == 1.0
    )
    assert precision_loss_from_hist(hist, 0.0, log2_min_normal=-126) == 0.0


def test_step_metrics():
    assert step_metrics(rec(0, 2.0, precision=0.3, loss=2.0)) == {
        "skipped": 0.0,
        "precision_loss": 0.3,
        "loss": 2.0,
    }
    m = step_metrics(rec(1, 2.0, found_inf=True, loss=math.inf))
    assert m["skipped"] == 1.0 and math.isnan(m["precision_loss"]) and m["loss"] == math.inf


def test_overflow_threshold_property():
    assert rec(0, 2.0**10, backward_amax=65504.0 / 2**7).overflow_threshold_log2 == pytest.approx(
        17.0
    )
    assert rec(0, 2.0**10).overflow_threshold_log2 is None
    assert rec(0, 2.0**10, backward_amax=math.inf).overflow_threshold_log2 is None


def test_summarize():
    cards = [
        Scorecard.from_records([rec(0, 4.0, loss=x)], eval_loss=x, hit_min=x > 2, wall_s=1.0)
        for x in (1.0, 2.0, 3.0)
    ]
    s = summarize(cards)
    assert s["eval_loss"] == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert s["hit_min"]["mean"] == pytest.approx(1 / 3)
    assert math.isnan(s["precision_loss"]["mean"]) is False and s["precision_loss"]["mean"] == 0.0
    with pytest.raises(ConfigError):
        summarize([])


def test_json_safe():
    assert json_safe({"a": [1.0, math.inf, (math.nan,)], "b": "x"}) == {
        "a": [1.0, None, [None]],
        "b": "x",
    }
