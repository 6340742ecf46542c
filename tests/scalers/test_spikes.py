"""A loss spike skipped by the guard (``amax-loss``'s ``spike_bits``): the spike steps are skipped
as GradScaler's overflow skips them, and move nothing else; a lasting rise is taken after
``spike_run`` of them; the packed (GPU) form, checkpoints and the agreed form carry it."""

from __future__ import annotations

import math

import pytest
import torch

import autoscale
from autoscale.errors import ConfigError
from autoscale.scalers import step_vector as sv
from autoscale.scalers.controller import StepStats
from autoscale.scalers.loss_guard import is_spike
from autoscale.scalers.rules.guard import LossGuard

from .helpers import adamw, batches, flat_params, forward_loss, tiny_model

CPU = torch.device("cpu")
SPIKE = 1000.0  # the loss times this on a spike step: just under 10 bits


def spiky(**kw) -> autoscale.LossScaler:
    return autoscale.get_scaler(
        "amax-loss", device="cpu", init_scale=2.0**12, **{"spike_bits": 8.0, **kw}
    )


def _loop(scaler, steps, spikes=(), rise_from=None, fused=False, packed=False, infs=()):
    """``steps`` steps of the tiny MLP; the loss times SPIKE at ``spikes`` and from
    ``rise_from`` on, times inf at ``infs``. Returns per step (skipped, stats, params moved), and
    the parameters at the end."""
    model = tiny_model()
    opt = adamw(model, fused=fused)
    rows = []
    for i, (x, y) in enumerate(batches(steps)):
        opt.zero_grad(set_to_none=True)
        before = flat_params(model)
        loss = forward_loss(model, x, y, inf=i in infs)
        if i in spikes or (rise_from is not None and i >= rise_from):
            loss = loss * SPIKE
        scaler.scale(loss).backward()
        if packed:
            scaler._cpu = False  # as a scaler on a GPU packs its step
        scaler.step(opt)
        scaler.update()
        moved = not torch.equal(before, flat_params(model))
        rows.append((scaler.step_was_skipped, scaler.last_stats, moved))
    return rows, flat_params(model)


def test_a_spike_is_skipped_and_moves_neither_the_scale_nor_the_guard():
    scaler = spiky()
    rows, _ = _loop(scaler, 60, spikes={25, 40})
    for i, (skipped, stats, moved) in enumerate(rows):
        spike = i in (25, 40)
        assert stats.spiked is spike and skipped is spike and moved is not spike, i
        if spike:
            assert stats.found_inf and math.isfinite(stats.loss)
            # the scale the next step starts from is the one the spike step was set at
            assert rows[i + 1][1].scale == rows[i - 1][1].scale or rows[i + 1][1].guarded
    assert scaler.controller.skipped == 2 and scaler.controller.min_hits == 0
    # the guard remembered no spike: its largest taken |loss| is a plain step's
    assert max(scaler.rule.guard.taken) < 2.0**8 * min(scaler.rule.guard.taken)
    # without spike_bits the guard takes the same spikes at a scale of their own
    rows, _ = _loop(spiky(spike_bits=0.0), 60, spikes={25, 40})
    assert [i for i, (skipped, _, _) in enumerate(rows) if skipped] == []
    assert rows[25][1].guarded and rows[25][2]


def test_a_lasting_rise_is_taken_after_spike_run_spikes():
    for run in (1, 2, 4):
        rows, _ = _loop(spiky(spike_run=run), 50, rise_from=30)
        assert [i for i, (s, _, _) in enumerate(rows) if s] == list(range(30, 30 + run))
        assert all(stats.spiked for _, stats, _ in rows[30 : 30 + run])
        assert all(moved for _, _, moved in rows[30 + run :])


def test_a_loss_alternating_with_far_smaller_ones_is_its_level_not_spikes():
    """GRPO-style fine-tuning: every other step's loss is near zero (the rollout's first step,
    advantages normalised to zero). A memory of those alone calls each other step a spike, and
    no two come in a row: the count over 16 steps takes the third (spike_cost.md found 149
    skipped in 2000 steps with a count in a row)."""
    scaler = spiky()
    model = tiny_model()
    opt = adamw(model)
    skipped = []
    for i, (x, y) in enumerate(batches(40)):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(model, x, y) * (1e-7 if i % 2 == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.step_was_skipped:
            skipped.append(i)
    assert skipped == [1, 3]  # then step 5 is taken, and its loss is the level


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_the_packed_step_skips_as_the_cpu_read_does(fused):
    """The GPU form (the spike test as a device flag, merged into the found-inf flag the fused
    kernel reads, and packed with the step) gives the CPU form's steps, bit for bit."""
    kw = dict(spikes={12, 33, 34, 35}, infs={10, 27}, fused=fused)
    read, params = _loop(spiky(), 45, **kw)
    packed, params_packed = _loop(spiky(), 45, packed=True, **kw)
    assert [repr(r[1]) for r in read] == [repr(p[1]) for p in packed]  # (NaN compares as text)
    assert [r[0] for r in read] == [p[0] for p in packed]
    assert torch.equal(params, params_packed)
    # 12 and 33-34 skipped as spikes, 35 taken (spike_run 2 in 16 steps), the inf batches as
    # overflows
    assert [i for i, r in enumerate(read) if r[1].spiked] == [12, 33, 34]
    assert [i for i, r in enumerate(read) if r[0]] == [10, 12, 27, 33, 34]


def test_a_checkpoint_carries_the_spike_memory_and_the_run():
    scaler = spiky()
    model = tiny_model()
    opt = adamw(model)
    data = batches(40)

    def step(s, i):
        x, y = data[i]
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(model, x, y) * (SPIKE if i >= 30 else 1.0)
        s.scale(loss).backward()
        s.step(opt)
        s.update()
        return s.step_was_skipped

    assert [step(scaler, i) for i in range(31)][-1]  # the rise's first step, skipped
    saved = scaler.state_dict()
    loaded = spiky(spike_bits=0.0)  # built with other settings: the checkpoint's come back
    loaded.load_state_dict(saved)
    assert loaded.rule.spike_bits == 8.0 and loaded.rule.guard.spikes == 1
    assert list(loaded.rule.guard.taken) == list(scaler.rule.guard.taken)
    # the second spike in a row is skipped, the third taken, by the loaded scaler as well
    assert [step(loaded, i) for i in (31, 32)] == [True, False]


def test_the_guard_forgets_the_largest_loss_when_it_leaves_its_memory():
    guard = LossGuard(spike_bits=3.0, spike_memory=4)
    assert guard.spike_limit() is None  # nothing taken yet

    def take(loss, spiked=False):
        guard.observe(1.0, StepStats(0, 1.0, spiked, 0.5, math.nan, loss, True, False, spiked))

    for loss in (8.0, 1.0, 1.0, 1.0):
        take(loss)
    assert guard.spike_limit() == 64.0
    take(1.0)  # 8 leaves the memory
    assert guard.spike_limit() == 8.0
    take(100.0, spiked=True)  # skipped: not remembered, one in a row
    assert guard.spike_limit() == 8.0 and guard.spikes == 1
    take(100.0, spiked=True)
    assert guard.spike_limit() is None  # spike_run (2) in 16 steps: the next is taken
    take(100.0)
    assert guard.spikes == 2 and guard.spike_limit() is None  # (still in the window)
    for _ in range(14):
        take(1.0)
    assert guard.spikes == 1 and guard.spike_limit() == 8.0  # the first spike left the window
    take(math.nan)  # a non-finite loss is no spike and no level
    assert guard.spikes == 0 and guard.spike_limit() == 8.0
    assert LossGuard().params()["spike_bits"] == 0.0 and "taken" not in LossGuard().state()
    assert guard.params()["spike_bits"] == 3.0 and guard.state()["taken"] == [1.0] * 4
    other = LossGuard(spike_bits=3.0, spike_memory=4)
    other.load_state(guard.state(), "test")
    assert other.spike_limit() == guard.spike_limit() and other.spikes == guard.spikes
    for bad in ({"recent": [2]}, {"recent": [0.5]}, {"recent": 1}, {"taken": [1.0, -2.0]}):
        with pytest.raises(ConfigError, match="not written by this rule"):
            other.load_state({**guard.state(), **bad}, "test")
    for key in ("spike_bits", "spike_memory", "spike_run"):
        with pytest.raises(ConfigError, match=key):
            LossGuard(**{key: -1})


def test_agreed_steps_carry_the_spike():
    other = torch.tensor([0.0, 0.5, 3.0, 20.0, 2.5, 1.0, 1.0])  # the other rank: a spike too

    def gather(local):
        assert local[-1].item() == 1.0  # a spike test made already travels last
        return [local, other]

    state = {"found_inf_per_device": {CPU: torch.tensor(1.0)}}
    stats = torch.tensor([0.25, 2.0, 10.0])
    spike = torch.tensor(True)
    sv.pack_into(state, stats, torch.tensor(1.5), 1, None, CPU, gather, spike)
    assert state[sv.LAYOUT] == sv.Layout(3, -1, True, False, True)
    sv.read([state])
    assert state[sv.HOST] == sv.HostStep(True, 0.5, 5.0, 30.0, 4.0, 2.0, True)
    stats_, _ = sv.step_stats([state], 3, 64.0, True, True)
    assert stats_.spiked and stats_.found_inf


@pytest.mark.parametrize("limit, spiked", [(2.0, True), (2.5, False), (0.5, True)])
def test_the_agreement_makes_the_spike_test_on_each_ranks_mean_loss(limit, spiked):
    """Made at the step's agreement, from the gathered losses: a spike where any rank's mean
    |loss| passes the limit (the other rank's 5.0 over 2 micro-batches: 2.5; this one's 1.5),
    the agreed found-inf flag set with it (the flag GradScaler and a fused kernel read)."""
    other = torch.tensor([0.0, 0.5, 3.0, 20.0, -5.0, 2.0])

    def gather(local):
        assert local.numel() == 6  # no element of its own: the losses are there already
        return [local, other]

    state = {"found_inf_per_device": {CPU: torch.tensor(0.0)}}
    stats = torch.tensor([0.25, 2.0, 10.0])
    out = sv.pack_into(state, stats, torch.tensor(1.5), 1, None, CPU, gather, limit=limit)
    assert out.item() == float(spiked)
    assert state["found_inf_per_device"][CPU].item() == float(spiked)
    sv.read([state])
    assert state[sv.HOST] == sv.HostStep(spiked, 0.5, 5.0, 30.0, -3.5, 3.0, spiked)


class _with_limit:
    """A rule whose spike limit is ``limit`` (the limit a step was tested against)."""

    scale_time = False

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def spike_limit(self) -> float:
        return self.limit


@pytest.mark.parametrize("packed", [False, True], ids=["cpu-read", "packed"])
def test_with_gradient_accumulation_the_steps_mean_loss_decides(packed):
    """Two micro-batches a step, one loss x 8 SPIKE on some steps: the step's mean loss
    (what a record keeps, and the replays test) decides, whichever micro-batch spiked; the
    scaler's test is the replays' (``is_spike`` on the step's loss, before the step)."""
    scaler = spiky()
    model = tiny_model()
    opt = adamw(model)
    data = batches(60)
    spikes_at = {20, 41}
    for i in range(30):
        opt.zero_grad(set_to_none=True)
        limit = scaler.rule.spike_limit()
        for j in (2 * i, 2 * i + 1):
            x, y = data[j]
            loss = forward_loss(model, x, y) / 2 * (8 * SPIKE if j in spikes_at else 1.0)
            scaler.scale(loss).backward()
        if packed:
            scaler._cpu = False  # as a scaler on a GPU packs its step
        scaler.step(opt)
        scaler.update()
        stats = scaler.last_stats
        assert stats.spiked is (i in (10, 20)), i  # the first micro-batch of 10, the second of 20
        assert stats.spiked is (limit is not None and abs(stats.loss) > limit)
        assert stats.spiked is (limit is not None and is_spike(_with_limit(limit), stats.loss))
        assert scaler.step_was_skipped is stats.spiked


def test_a_spike_at_the_minimum_scale_is_no_overflow_there():
    scaler = spiky(min_scale=2.0**12, raise_at_min=True)  # every step at the minimum
    rows, _ = _loop(scaler, 30, spikes={20})
    assert rows[20][1].spiked and rows[20][1].scale == 2.0**12
    assert scaler.controller.min_hits == 0  # no MinimumLossScaleError either


def test_what_cannot_honour_spike_bits_refuses_it_or_forwards_it(tmp_path):
    """A window that could never open, a neural policy's guard (which lowers scales only) and
    a guard pickled before spikes: refused, or read as no spikes; a residual forwards its base's."""
    import shutil

    import yaml

    from autoscale.errors import PolicyError
    from autoscale.scalers.residual import ResidualRule
    from autoscale.scalers.rules.amax import AmaxLossRule

    from .helpers import FIXTURE_POLICIES

    with pytest.raises(ConfigError, match="spike_run must be at most 16"):
        LossGuard(spike_bits=4.0, spike_run=17)
    folder = tmp_path / "neural-spiky"
    shutil.copytree(FIXTURE_POLICIES / "fixture-neural", folder)
    manifest = yaml.safe_load((folder / "policy.yaml").read_text())
    manifest["name"] = "neural-spiky"
    manifest["parameters"]["guard"] = {"guard_history": 16, "guard_margin": 1.0, "spike_bits": 4}
    (folder / "policy.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(PolicyError, match="does not skip loss spikes"):
        autoscale.get_scaler(str(folder), device="cpu")
    base = AmaxLossRule(spike_bits=4.0)
    base.guard.observe(1.0, StepStats(0, 1.0, False, 0.5, math.nan, 2.0, True, False))
    assert ResidualRule(base).spike_limit() == base.spike_limit() == 32.0
    old = LossGuard()
    for key in ("spike_bits", "spike_memory", "spike_run"):
        del old.__dict__[key]  # as unpickled from before spikes existed
    old.observe(1.0, StepStats(0, 1.0, False, 0.5, math.nan, 2.0, True, False))
    assert old.spike_limit() is None and old.params()["spike_bits"] == 0.0


def test_a_recorded_spike_keeps_its_gradients_threshold(tmp_path):
    """The record says a step was skipped as a spike, and its overflow threshold is the one its
    finite gradients give (a replay of another rule then takes it where that scale fits), not
    the guess an overflow gets (a bit below the scale used)."""
    from autoscale.observe import read_record, watch_scaler

    scaler = spiky()
    watch = watch_scaler(scaler, record=str(tmp_path / "r"), hist_every=1)
    _loop(scaler, 40, spikes={25})
    watch.close()
    row = read_record(tmp_path / "r").steps[25]
    assert row["found_inf"] and row["spiked"] and math.isfinite(row["amax"])
    assert row["threshold"] == pytest.approx(math.log2(65504.0 / row["amax"]))
    assert row["threshold"] > math.log2(row["scale"])  # its gradients fit at its scale
