"""The modules LossScaler delegates to, each on its own: the packed step, the loss guard,
checkpoints, agreement across ranks, the gradient reader and unscaling."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
import torch.distributed as dist

from autoscale.errors import ConfigError
from autoscale.scalers import step_vector as sv
from autoscale.scalers.checkpoint import STATE_VERSION, read_state, write_state
from autoscale.scalers.controller import ScaleBounds, ScaleController, f32
from autoscale.scalers.grad_reader import GradReader
from autoscale.scalers.grad_stats import grad_stats
from autoscale.scalers.loss_guard import apply_guard, guard_scale_host, guarded_scale, guards
from autoscale.scalers.ranks import RankAgreement
from autoscale.scalers.rules import TorchRule
from autoscale.scalers.unscale import InverseScale

CPU = torch.device("cpu")


# ---------------------------------------------------------------- step_vector
@pytest.mark.parametrize("with_stats", [0, 1, 3])
@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("n_loss", [0, 2])
def test_a_packed_step_reads_back_as_it_was_packed(with_stats, guarded, n_loss):
    stats = {0: None, 1: torch.tensor(0.25), 3: torch.tensor([0.25, 4.0, 16.0])}[with_stats]
    loss = torch.tensor(3.0) if n_loss else None
    guard = torch.tensor(512.0) if guarded else None
    state = {"found_inf_per_device": {CPU: torch.tensor(1.0)}}
    sv.pack_into(state, stats, loss, n_loss, guard, CPU, None)
    assert state[sv.LAYOUT] == sv.Layout(with_stats, n_loss, False, guarded)
    sv.read([state])
    host = state[sv.HOST]
    assert host.found is True
    if with_stats:
        assert host.amax == 0.25
    else:
        assert math.isnan(host.amax)
    if with_stats == 3:
        assert (host.sumsq, host.count) == (4.0, 16.0)
    else:
        assert math.isnan(host.sumsq) and host.count == 0.0
    assert (host.loss_sum, host.loss_count) == ((3.0, 2.0) if n_loss else (0.0, 0.0))
    assert state.get(sv.USED) == (512.0 if guarded else None)


def test_agreed_steps_take_max_of_flags_and_amax_and_sum_of_the_rest():
    other = torch.tensor([0.0, 0.5, 3.0, 20.0, 2.5, 1.0])  # what the other rank sends
    sent = []

    def gather(local):
        sent.append(local.clone())
        return [local, other]

    # this rank overflowed: its amax is NaN, sent as inf (a NaN would win no MAX)
    state = {"found_inf_per_device": {CPU: torch.tensor(1.0)}}
    stats = torch.tensor([math.nan, 2.0, 10.0])
    sv.pack_into(state, stats, torch.tensor(1.5), 1, None, CPU, gather)
    assert sent[0].tolist() == [1.0, math.inf, 2.0, 10.0, 1.5, 1.0]
    assert state["found_inf_per_device"][CPU].item() == 1.0  # the flag fused kernels read: agreed
    sv.read([state])
    assert state[sv.HOST] == sv.HostStep(True, math.inf, 5.0, 30.0, 4.0, 2.0)


def test_step_stats_of_two_optimizers_in_one_read():
    states = []
    for amax, loss in ((0.5, 2.0), (0.75, None)):
        state = {"found_inf_per_device": {CPU: torch.tensor(0.0)}}
        loss_t = None if loss is None else torch.tensor(loss)
        stats = torch.tensor([amax, 4.0, 4.0])
        sv.pack_into(state, stats, loss_t, 1 if loss_t is not None else 0, None, CPU, None)
        states.append(state)
    stats, used = sv.step_stats(states, 7, 1024.0, True, True)
    assert used is None and stats.step == 7 and stats.scale == 1024.0 and not stats.found_inf
    assert stats.grad_amax == 0.75 and stats.grad_rms == 1.0 and stats.loss == 2.0
    assert not stats.guarded


# ---------------------------------------------------------------- loss_guard
def test_the_three_forms_of_the_guard_agree_for_positive_limits():
    rng = random.Random(0)
    for _ in range(2000):
        limit = 2.0 ** rng.uniform(-5, 40)
        loss = (
            rng.choice([0.0, math.inf, -math.inf, math.nan])
            if rng.random() < 0.1
            else (rng.choice([-1, 1]) * 10.0 ** rng.uniform(-12, 12))
        )
        set_scale, min_scale = 2.0 ** rng.randint(0, 24), 1.0
        host = guard_scale_host(limit, loss, min_scale, set_scale)
        assert host == guarded_scale(set_scale, loss, limit, min_scale), (limit, loss, set_scale)
        scale = torch.full((), set_scale)
        assert apply_guard(scale, torch.tensor(loss), limit, min_scale, set_scale, None) is None
        assert scale.item() == f32(host)


def test_a_limit_that_is_not_positive_is_no_guard_in_every_form():
    """The one decision of whether a step is guarded (``guards``): the host forms keep the set
    scale, and the scaler never runs the device ops (they would give NaN for a negative limit)."""
    for limit in (None, 0.0, -1.0, -math.inf):
        assert not guards(limit)
        assert guarded_scale(2.0**12, 3.0, limit, 1.0) == 2.0**12
    assert guards(1e-30) and guards(math.inf)

    from autoscale.scalers import LossScaler
    from autoscale.scalers.rules import TorchRule

    class Negative(TorchRule):
        has_guard = True

        def guard_limit(self):
            return -1.0

    scaler = LossScaler(Negative(), "cpu", init_scale=2.0**12, min_scale=1.0)
    scaler.scale(torch.tensor(5.0, requires_grad=True))
    assert scaler.get_scale() == 2.0**12 and not scaler._guarded


def test_guard_edges():
    assert guarded_scale(2.0**12, 1.0, None, 1.0) == 2.0**12  # no guard: the set scale
    assert guarded_scale(2.0**12, 1e12, 2.0**15, 1.0) == 1.0  # never below the minimum
    assert guard_scale_host(2.0**15, 2.0, 1.0, 2.0**20) == 2.0**14  # the largest power of two
    assert guard_scale_host(2.0**15, 2.0, 1.0, 2.0**10) == 2.0**10  # never above the set scale


# ---------------------------------------------------------------- checkpoint
def _controller(steps=3):
    rule = TorchRule(growth_interval=5)
    rule.load_state({"growth_tracker": 2})
    ctl = ScaleController(rule, ScaleBounds.of(1.0, 2.0**24))
    ctl.load_counters({"steps": steps, "skipped": 1, "min_hits": 0})
    return ctl


def test_a_state_round_trips_and_keeps_gradscalers_keys():
    ctl = _controller()
    knobs = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}
    state = write_state("torch", 4096.0, knobs, ctl)
    assert state["scale"] == 4096.0 and state["_growth_tracker"] == 2
    assert state["autoscale"]["version"] == STATE_VERSION
    loaded = read_state(state, "torch", ctl.bounds)
    assert loaded.scale == 4096.0 and loaded.rule_state == {"growth_tracker": 2}
    assert loaded.counters == {"steps": 3, "skipped": 1, "min_hits": 0}
    plain = read_state({"scale": 8.0, "_growth_tracker": 4}, "torch", ctl.bounds)
    assert plain.counters is None and plain.rule_state == {"growth_tracker": 4}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s["autoscale"].pop("rule"), "names no rule"),
        (lambda s: s["autoscale"].update(version=STATE_VERSION + 1), "upgrade autoscale"),
        (lambda s: s["autoscale"].update(steps=-1), "not integers >= 0"),
        (lambda s: s["autoscale"].pop("rule_state"), "lacks"),
        (lambda s: s.update(scale=math.inf), "not a positive finite number"),
        (lambda s: s.update(autoscale=[1]), "must be a mapping"),
    ],
)
def test_a_bad_state_is_named(change, match):
    ctl = _controller()
    state = write_state("torch", 64.0, {}, ctl)
    change(state)
    with pytest.raises(ConfigError, match=match):
        read_state(state, "torch", ctl.bounds)


def test_other_bounds_and_a_clamped_scale_are_warned_about():
    ctl = _controller()
    state = write_state("torch", 2.0**30, {}, ctl)
    state["autoscale"]["max_scale"] = 2.0**40
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = read_state(state, "torch", ctl.bounds)
    assert loaded.scale == 2.0**24
    text = " ".join(str(w.message) for w in caught)
    assert "keeps its own" in text and "continuing from" in text
    with pytest.raises(RuntimeError, match="empty"):
        read_state({}, "torch", ctl.bounds)


# ---------------------------------------------------------------- ranks
def test_rank_agreement_outside_torch_distributed(tmp_path):
    with pytest.raises(ConfigError, match="must be a torch.distributed ProcessGroup"):
        RankAgreement(process_group="world")
    assert RankAgreement().group(CPU, needs_loss=True) is None  # not initialised: nothing to agree
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        agreement = RankAgreement()
        assert agreement.group(CPU, needs_loss=True) is None  # one rank: nothing to agree
        assert agreement.checked
        local = torch.tensor([1.0, 2.0])
        assert [t.tolist() for t in agreement.gather(local, dist.group.WORLD)] == [[1.0, 2.0]]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- grad_reader and unscale
def _optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    (model(torch.randn(3, 8)).square().sum() * 64).backward()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _unscaled(grads, inv, rms=False):
    """The reader's one-pass unscale of ``grads``: (found-inf flag, statistics)."""
    reader, state = GradReader(), {}
    reader.rms = rms
    reader.unscale(state, grads, inv, CPU)
    return state["found_inf_per_device"][CPU], state[sv.STATS]


def test_the_reader_keeps_abs_and_norm_for_one_step():
    model, opt = _optimizer()
    reader = GradReader()
    reader.rms = reader.keep_abs = True
    state: dict = {}
    seen = []
    reader.collect(opt, state, CPU, None, 5, seen.append)
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads]).abs()
    assert len(seen) == 1 and len(seen[0]) == 2
    assert torch.equal(reader.grad_abs(opt, 5), flat) and reader.grad_abs(opt, 6) is None
    assert reader.grad_norm(opt, 5).item() == pytest.approx(flat.norm().item(), rel=1e-6)
    assert state[sv.STATS].tolist() == pytest.approx(
        [flat.max().item(), flat.square().sum().item(), flat.numel()], rel=1e-6
    )
    reader.forget()
    assert reader.grad_abs(opt, 5) is None and reader.grad_norm(opt, 5) is None


@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=str)
def test_the_one_pass_reads_the_rms_as_the_general_path_does(bad):
    _, opt = _optimizer()
    ours = [p.grad.clone() for group in opt.param_groups for p in group["params"]]
    if bad is not None:
        ours[0][1, 2] = bad
    theirs = [g.clone() for g in ours]
    scaled = [g.clone() for g in ours]
    inv = InverseScale()(torch.full((), 64.0), 64.0, False, None)
    flag, stats = _unscaled(ours, inv, rms=True)
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, inv)
    ref, _ = grad_stats(theirs, CPU, None, rms=True)  # GradScaler's unscale, then the read
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(ours, theirs))
    assert flag.item() == found.item() == (bad is not None)
    assert repr(stats.tolist()) == repr(ref.tolist())  # bit for bit, NaN and inf included
    # the fused-optimizer path: statistics of the still-scaled gradients, times 1/scale
    reader, state = GradReader(), {}
    reader.rms = True
    reader.amax(state, scaled, inv, CPU)
    ref, _ = grad_stats(scaled, CPU, inv, rms=True)
    assert repr(state[sv.STATS].tolist()) == repr(ref.tolist())


def test_the_one_pass_unscale_is_gradscalers_bit_for_bit():
    _, opt = _optimizer()
    ours = [p.grad.clone() for group in opt.param_groups for p in group["params"]]
    theirs = [g.clone() for g in ours]
    inv = InverseScale()(torch.full((), 64.0), 64.0, False, None)
    assert inv.item() == f32(1 / 64.0)
    flag, amax = _unscaled(ours, inv)
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, inv)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert flag.item() == found.item() == 0.0
    assert amax.item() == max(g.abs().max().item() for g in theirs)
    guard = torch.tensor(16.0, dtype=torch.float64)
    assert InverseScale()(torch.full((), 64.0), 64.0, True, guard).item() == 1 / 16.0
