"""A user's record as replay sees it: the steps that overflowed in the run."""

from __future__ import annotations

import math

import numpy as np

import autoscale
from autoscale.envs.from_records import trace_from_record
from autoscale.observe import read_record, watch_scaler
from tests.observe.helpers import fp16_loop


def test_an_overflowed_step_shows_the_amax_its_threshold_implies(tmp_path):
    """Replay at a scale below an overflowed step's threshold runs it clean: the rule must see
    the amax the threshold implies, not a NaN (which the amax rules read as an overflow). A
    non-finite loss fails at every scale and keeps NaN."""
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**24, growth_interval=20)
    watch = watch_scaler(scaler, record=str(tmp_path / "r"))
    fp16_loop(scaler, 120, bad={60}, weight=2.0**4)  # overflows from 2^24 down, one inf batch
    watch.close()
    record = read_record(tmp_path / "r")
    trace = trace_from_record(record)
    (inst,) = trace.instances.values()
    steps = record.steps
    overflowed = [i for i, s in enumerate(steps) if s["found_inf"] and not s["loss_nonfinite"]]
    nonfinite = [i for i, s in enumerate(steps) if s["loss_nonfinite"]]
    assert overflowed and nonfinite == [60]
    for i in overflowed:
        assert math.isfinite(inst.amax[i]) and inst.amax[i] > 0
        assert math.log2(65504.0 / inst.amax[i]) == inst.threshold[i]
    assert np.isnan(inst.amax[60])
    clean = [i for i, s in enumerate(steps) if not s["found_inf"]]
    assert [inst.amax[i] for i in clean] == [steps[i]["amax"] for i in clean]


def test_a_records_windows_hold_two_out_where_its_length_allows():
    """Three windows hold one out, and one held-out window cannot measure a lead's noise (the
    search on a 1000-step record stopped at once, where a 700-step record of the same run was
    searched): the windows are the longest that give four, down to 64 steps."""
    from autoscale.envs.from_records import records_horizon

    assert [records_horizon(n) for n in (192, 300, 600, 700, 1000, 1023, 1024, 1300)] == [
        64, 64, 128, 128, 128, 128, 256, 256,
    ]  # fmt: skip
    assert records_horizon(10**6) == 2048
    for n in (600, 700, 1000, 1300, 5000, 9000):  # two held out wherever 4 windows of 64 fit
        windows = n // records_horizon(n)
        assert windows - max(1, 2 * windows // 3) >= 2
