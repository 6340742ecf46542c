"""Precision loss and the overflow threshold, checked against references."""

import math

import pytest
import torch

from autoscale.training import TrainingRun, WorkloadSpec, precision_loss_from_hist
from autoscale.training.instruments import GradientCensus, log2_histogram, underflow_counts


def test_underflow_counts_exact():
    g = [
        torch.tensor([0.0, 2.0**-20, -(2.0**-19), 2.0**-18, 1.0]),
        torch.tensor([[2.0**-30, 0.0], [-(2.0**-10), 0.0]]),
    ]
    # scale 2^4: lost when |g| < 2^-18  ->  2^-20, 2^-19, 2^-30 (zeros are not counted)
    below, nonzero = underflow_counts(g, 2.0**4).tolist()
    assert (below, nonzero) == (3.0, 6.0)
    below, nonzero = underflow_counts(g, 2.0**4, min_normal=2.0**-126).tolist()
    assert (below, nonzero) == (0.0, 6.0)


def test_census_reuses_its_buffer():
    census = GradientCensus()
    buffer = census.load([torch.tensor([1.0, -(2.0**-30)])])
    assert census.underflow_counts(1.0).tolist() == [1, 2]
    assert census.load([torch.tensor([0.0, 2.0**-30])]) is buffer
    assert census.underflow_counts(2.0**20).tolist() == [0, 1]
    assert census.load([torch.ones(3)]) is not buffer  # a different size gets a new buffer
    assert census.underflow_counts(1.0).tolist() == [0, 3]


def test_log2_histogram_exact():
    g = [torch.tensor([0.0, 1.0, 1.5, -0.25, 2.0**-70, 2.0**20, math.inf, math.nan])]
    counts = log2_histogram(g).tolist()
    assert sum(counts) == 5  # zero, inf and nan are left out
    assert counts[64] == 2 and counts[62] == 1  # [0, 1): 1 and 1.5; [-2, -1): 0.25
    assert counts[0] == 1 and counts[79] == 1  # beyond either end: first and last bin


def test_log2_histogram_bins_by_the_exponent_bits():
    below = torch.nextafter(torch.tensor(2.0**-20), torch.tensor(0.0)).item()  # log2 rounds to -20
    g = [torch.tensor([below, 2.0**-20, 1e-40, -3.0 * 2.0**-30], dtype=torch.float32)]
    counts = log2_histogram(g).tolist()
    assert counts[-21 + 64] == 1 and counts[-20 + 64] == 1  # exact floor(log2|g|)
    assert counts[-29 + 64] == 1 and counts[0] == 1  # sign ignored; fp32 subnormal: first bin
    assert sum(counts) == 4


@pytest.mark.parametrize("model", ["gpt2-tiny", "mlp"])
def test_precision_loss_matches_fp32_reference(model):
    """The fp16 step's estimate vs the same step in fp32: the share of fp32 gradients with
    |g|*S below 2^-14 among those fp16 can represent at all (|g|*S >= 2^-24)."""
    scale = 2.0**12
    spec = WorkloadSpec(model=model, scenario="small-grads", clip=None)
    fp16 = TrainingRun(spec, "static", record=True, init_scale=scale)
    rec = fp16.step()
    ref = TrainingRun(
        spec.replace(dtype="fp32"), "static", init_scale=scale
    )  # same init, batch, dropout
    ref.step()
    g = (
        torch.cat([p.grad.flatten() for p in ref.model.parameters() if p.grad is not None]).abs()
        * scale
    )
    representable = g >= 2.0**-24
    reference = ((g < 2.0**-14) & representable).sum().item() / representable.sum().item()
    assert 0.3 < reference < 0.7  # a regime where the metric matters
    assert rec.precision_loss == pytest.approx(reference, abs=0.02)
    # the histogram estimate (what a replay uses) agrees with the fused count exactly at 2^k scales
    assert precision_loss_from_hist(rec.grad_log2_hist, math.log2(scale)) == pytest.approx(
        rec.precision_loss, abs=1e-9
    )
    assert sum(rec.grad_log2_hist) == pytest.approx(1.0)


def test_overflow_threshold_predicts_overflow():
    """One recorded backward at a safe scale predicts the scale at which the same step overflows."""
    run = TrainingRun(WorkloadSpec(model="mlp"), "static", record=True, init_scale=2.0**8)
    run.run(3)
    snap = run.snapshot()
    first = run.step()
    threshold = first.overflow_threshold_log2
    assert 12 < threshold < 24 and first.backward_amax >= first.grad_amax * first.scale
    for delta, overflows in ((-0.25, False), (0.25, True)):
        run.restore(snap)
        run.scaler.set_scale(2.0 ** (threshold + delta))
        rec = run.step()
        assert rec.found_inf is overflows
        assert (rec.backward_amax == math.inf) is overflows
        assert (rec.overflow_threshold_log2 is None) is overflows


def test_record_extras_absent_unless_asked_or_not_fp16():
    rec = TrainingRun(WorkloadSpec(model="mlp"), "torch").step()
    assert (
        rec.grad_log2_hist is None
        and rec.backward_amax is None
        and rec.overflow_threshold_log2 is None
    )
    rec = TrainingRun(WorkloadSpec(model="mlp", dtype="bf16"), "torch", record=True).step()
    assert rec.backward_amax is None and len(rec.grad_log2_hist) == 80
    assert rec.precision_loss == 0.0  # bf16's range: nothing below its normal minimum at scale 2^16


def test_underflow_counts_integer_compare_agrees_with_float_compare():
    """The count compares bit patterns; the float comparison is the reference, at scales that are
    not powers of two, beyond float32's range, and with NaN, inf and zeros in the gradients."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(4096, generator=gen) * torch.exp2(
        torch.randint(-40, 10, (4096,), generator=gen)
    )
    g[:7] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3e38])
    census = GradientCensus()
    census.load([g])
    flat = g.abs()
    for scale in (2.0**-30, 1e-40, 0.37, 1.0, 3.0, 2.0**16, 65537.5, 2.0**40):
        limit = torch.tensor(2.0**-14 / scale, dtype=torch.float64).float()  # as torch rounds it
        nonzero = int((flat != 0).sum())
        below = int(((flat < limit) & (flat != 0)).sum())
        assert census.underflow_counts(scale).tolist() == [below, nonzero], scale
    # bf16/fp32's normal minimum 2^-126 at a scale of 2^24: the limit rounds to 0 in float32,
    # and no non-zero |g| is below it (zeros are not counted either way)
    census.load([torch.tensor([0.0, -0.0, 1e-30, 1.0])])
    assert census.underflow_counts(2.0**24, min_normal=2.0**-126).tolist() == [0, 2]


def test_run_counts_on_the_scalers_copy_of_the_gradients():
    """On CPU the scaler's statistics copy |g| into a buffer once; the run's census counts on that
    buffer (no second copy) and gets what a census of its own copy gets."""
    run = TrainingRun(
        WorkloadSpec(model="mlp", scenario="small-grads"), "static", init_scale=2.0**8
    )
    seen = []
    original = run.census.adopt

    def adopt(flat):
        seen.append(flat)
        mine = GradientCensus()
        mine_abs = mine.load([p.grad for p in run.model.parameters() if p.grad is not None])
        out = original(flat)
        assert (
            run.census.underflow_counts(2.0**8).tolist() == mine.underflow_counts(2.0**8).tolist()
        )
        assert torch.equal(torch.sort(flat).values, torch.sort(mine_abs).values)
        return out

    run.census.adopt = adopt
    rec = run.step()
    run.step()
    assert len(seen) == 2 and seen[0] is seen[1]  # one buffer, reused
    assert (
        run.scaler.grads.grad_abs(run.optimizer, run.scaler.steps) is None
    )  # after update(): a past step's gradients
    assert 0 < rec.precision_loss < 1


def test_a_guarded_step_loses_precision_at_the_scale_it_used():
    """amax-loss's guard lowers a spike's scale when the loss is scaled: the step's precision
    loss is counted at that lowered scale, as a run setting the same scales outright counts it
    (it was counted at the scale set before the guard ran)."""
    spec = WorkloadSpec(
        model="mlp", scenario="preference", scenario_params={"beta": 50}, dtype="fp16", seed=3
    )
    bounds = {"init_scale": 65536, "min_scale": 1.0, "max_scale": 2**40}
    guarded = TrainingRun(spec, "amax-loss", **bounds)
    guarded.run(48)
    lowered = [r for r in guarded.records if r.stats.guarded and not r.found_inf]
    assert lowered, "no step's loss called for a lower scale: the test shows nothing"
    plain = TrainingRun(spec, "static", **bounds)
    for rec in guarded.records:
        plain.scaler.set_scale(rec.scale)
        again = plain.step()
        assert again.scale == rec.scale and again.found_inf == rec.found_inf
        if not rec.found_inf:
            assert again.precision_loss == rec.precision_loss, rec.step
    assert any(r.precision_loss > 0 for r in lowered)
