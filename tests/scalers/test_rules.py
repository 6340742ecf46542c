"""Each classic rule against a hand-computed sequence of overflow flags.

The expected sequences were worked out by hand from the published code paths quoted in the rules'
docstrings. Most tests drive the rule through real ``scale``/``step``/``update`` calls on a tiny
model (``T`` = that step's loss is multiplied by inf); a few feed ``next_scale`` directly where
the statistics must take exact values.
"""

from __future__ import annotations

import math

import pytest
import torch

import autoscale
from autoscale.errors import ConfigError
from autoscale.scalers import FP16_MAX, StepStats
from tests.scalers.helpers import adamw, batches, forward_loss, run, tiny_model

T, F = True, False


def drive(
    name: str, flags: list[bool], fused: bool = False, **kw
) -> tuple[list[float], autoscale.LossScaler]:
    """Run ``len(flags)`` real steps; return the scale after each ``update()`` and the scaler."""
    scaler = autoscale.get_scaler(name, device="cpu", **kw)
    model = tiny_model()
    trace = run(
        model,
        adamw(model, fused=fused),
        scaler,
        batches(len(flags)),
        [i for i, f in enumerate(flags) if f],
    )
    assert trace.skipped == [i for i, f in enumerate(flags) if f], "a step overflowed by itself"
    return trace.after, scaler


def feed(scaler: autoscale.LossScaler, flags: list[bool]) -> list[float]:
    """Drive the rule directly, through the scaler's controller as ``update()`` does (clamped and
    rounded to float32)."""
    out, scale = [], scaler.get_scale()
    for i, found in enumerate(flags):
        scale = scaler.controller.step(StepStats(i, scale, found))
        out.append(scale)
    return out


# ---------------------------------------------------------------- static
def test_static_never_moves():
    flags = [F, T, T, F, F, F, F, T, F, F]
    after, scaler = drive("static", flags)
    assert after == [128.0] * 10
    assert scaler.skipped == 3


# ---------------------------------------------------------------- torch
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_torch_grows_after_interval_and_halves_on_overflow(fused):
    flags = [F, F, F, T, F, F, F, F, T, T, F, F, F]
    after, scaler = drive("torch", flags, fused=fused, init_scale=16.0, growth_interval=3)
    assert after == [16, 16, 32, 16, 16, 16, 32, 32, 16, 8, 8, 8, 16]
    assert scaler.state_dict()["_growth_tracker"] == 0


# ---------------------------------------------------------------- DeepSpeed
def test_deepspeed_first_growth_after_window_plus_one_and_hysteresis():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    flags = [F, F, F, F, T, T, F, F, F, F, T, F, T, T]
    after, _ = drive("deepspeed", flags, init_scale=16.0, loss_scale_window=3)
    # growth at step 3 = window+1 clean steps (stable_interval = cur_iter - last_overflow - 1 = 3);
    # step 4 spends the hysteresis, step 5 halves; after that a clean step does not refill it
    # (only a growth does), so step 12 halves at once and step 13 halves again.
    assert after == [16, 16, 16, 32, 32, 16, 16, 16, 16, 32, 32, 32, 16, 8]


def test_deepspeed_consecutive_hysteresis_refills_on_every_clean_step():
    flags = [F, F, F, F, T, T, F, F, F, F, T, F, T, T]
    after, _ = drive(
        "deepspeed", flags, init_scale=16.0, loss_scale_window=3, consecutive_hysteresis=True
    )
    # same as above until step 11, whose clean step refills the hysteresis: step 12 only spends it
    assert after == [16, 16, 16, 32, 32, 16, 16, 16, 16, 32, 32, 32, 32, 16]


def test_deepspeed_growth_window_restarts_after_overflow():
    scaler = autoscale.get_scaler(
        "deepspeed", device="cpu", init_scale=16.0, loss_scale_window=2, hysteresis=1
    )
    # overflow at 1 -> 8; clean steps 2, 3, 4: stable_interval 0, 1, 2 -> growth at step 4
    assert feed(scaler, [F, T, F, F, F, F, F]) == [16, 8, 8, 8, 16, 16, 32]


def test_deepspeed_min_scale_and_raise_only_when_hysteresis_is_used_up():
    scaler = autoscale.get_scaler("deepspeed", device="cpu", init_scale=2.0, raise_at_min=False)
    assert scaler.min_scale == 1.0  # DeepSpeed's min_loss_scale default
    assert feed(scaler, [T, T, T, T]) == [2, 1, 1, 1]

    flags = [T, T, T]
    with pytest.raises(autoscale.errors.MinimumLossScaleError, match="already at minimum"):
        drive("deepspeed", flags, init_scale=1.0, raise_at_min=True)
    # at the minimum, the first overflow only spends the hysteresis (DeepSpeed raises on the second)
    after, scaler = drive("deepspeed", [T], init_scale=1.0, raise_at_min=True)
    assert after == [1.0] and scaler.rule.cur_hysteresis == 1


# ---------------------------------------------------------------- Megatron
def test_megatron_hysteresis_refilled_only_on_growth():
    #        0  1  2  3  4  5  6  7  8  9 10
    flags = [T, T, T, F, F, T, F, F, F, T, T]
    after, scaler = drive("megatron", flags, init_scale=16.0, growth_interval=3)
    # 0 spends the hysteresis; 1 and 2 halve; clean steps 3-4 do not refill it, so 5 halves at once;
    # the growth at 8 refills it: 9 only spends it, 10 halves.
    assert after == [16, 8, 4, 4, 4, 2, 2, 2, 4, 4, 2]
    assert scaler.rule.state() == {"growth_tracker": 0, "hysteresis_tracker": 0}


def test_megatron_defaults():
    scaler = autoscale.get_scaler("megatron", device="cpu")
    assert scaler.get_scale() == 2.0**32 and scaler.min_scale == 1.0
    assert (scaler.rule.growth_interval, scaler.rule.hysteresis) == (1000, 2)


# ---------------------------------------------------------------- jmp
def test_jmp_period():
    flags = [F, F, F, T, F, F, F, F, F, T, T, F]
    after, _ = drive("jmp", flags, init_scale=16.0, period=3)
    assert after == [16, 16, 32, 16, 16, 16, 32, 32, 32, 16, 8, 8]


def test_jmp_floor_is_min_scale():
    scaler = autoscale.get_scaler("jmp", device="cpu", init_scale=4.0)
    assert feed(scaler, [T, T, T, T]) == [2, 1, 1, 1]


# ---------------------------------------------------------------- fairseq
def test_fairseq_tolerance():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    flags = [F, F, F, F, T, F, F, T, T, F, F, F, F]
    after, _ = drive("fairseq", flags, init_scale=16.0, scale_window=4, tolerance=0.5)
    # growth when (iter - last_overflow) % window == 0: at 3 (4 clean steps from the start);
    # 4 backs off (1 overflow in 1 step since the rescale at 3); 7 does not (1 in 3 < 0.5);
    # 8 does (2 in 4 = 0.5); then 4 clean steps after the overflow at 8 grow at 12.
    assert after == [16, 16, 16, 32, 16, 16, 16, 16, 8, 8, 8, 8, 16]


def test_fairseq_zero_tolerance_backs_off_on_every_overflow():
    scaler = autoscale.get_scaler("fairseq", device="cpu", init_scale=16.0, scale_window=4)
    assert feed(scaler, [F, T, F, T, T, F, F, F, F]) == [16, 8, 8, 4, 2, 2, 2, 2, 4]
    assert scaler.rule.scale_window == 4


# ---------------------------------------------------------------- metaseq
def test_metaseq_window_doubles_on_growth_and_halves_on_backoff():
    flags = [F, F, F, F, F, F, F, F, T] + [F] * 8 + [T, T, F, F, F, F]
    windows = []
    scaler = autoscale.get_scaler("metaseq", device="cpu", init_scale=4.0, scale_window=2)
    model = tiny_model()
    trace = run(
        model,
        adamw(model),
        scaler,
        batches(len(flags)),
        [i for i, f in enumerate(flags) if f],
        each=lambda i: windows.append(scaler.rule.scale_window),
    )
    expected = [4, 8, 8, 16, 16, 16, 16, 32, 16] + [16] * 7 + [32, 16, 8, 8, 8, 8, 16]
    assert trace.after == expected
    assert windows == [2, 4, 4, 8, 8, 8, 8, 16, 8] + [8] * 7 + [16, 8, 4, 4, 4, 4, 8]
    # the window is state: a checkpoint keeps the grown one, the parameters keep the initial one
    assert scaler.state_dict()["autoscale"]["rule_state"]["scale_window"] == 8
    assert scaler.rule.params()["scale_window"] == 2


def test_metaseq_window_never_below_one():
    scaler = autoscale.get_scaler("metaseq", device="cpu", init_scale=4.0, scale_window=2)
    feed(scaler, [T, T, T])
    assert scaler.rule.scale_window == 1
    assert scaler.min_scale == 2.0**-5


# ---------------------------------------------------------------- amax-history
def _expected_amax_scale(history: list[float], margin: float) -> float:
    return 2.0 ** math.floor(math.log2(FP16_MAX / max(history)) - margin)


def test_amax_history_hand_computed():
    scaler = autoscale.get_scaler("amax-history", device="cpu", history_len=3, margin=2.0)
    steps = [  # (found_inf, amax) -> scale
        ((F, 1.0), 2.0**13),  # log2(65504 / 1) - 2 = 13.9997
        ((F, 0.25), 2.0**13),  # max over [1, .25]
        ((F, 0.01), 2.0**13),
        ((F, 0.01), 2.0**15),  # 1.0 left the history: max .25 -> 15.9997
        ((T, math.inf), 2.0**14),  # overflow: x0.5, history kept
        ((F, 0.01), 2.0**20),  # history [.01, .01, .01]: log2(6550400) - 2 = 20.64
        ((F, 3.0), 2.0**12),  # log2(65504 / 3) - 2 = 12.41
        ((F, 0.0), 2.0**12),  # an all-zero gradient says nothing: not recorded
    ]
    scale = scaler.get_scale()
    for i, ((found, amax), expected) in enumerate(steps):
        scale = scaler.rule.next_scale(scale, StepStats(i, scale, found, grad_amax=amax))
        assert scale == expected, f"step {i}"
    assert scaler.rule.state() == {"history": [0.01, 0.01, 3.0]}


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_amax_history_on_real_steps(fused):
    scaler = autoscale.get_scaler(
        "amax-history", device="cpu", history_len=3, margin=2.0, init_scale=2.0**8
    )
    model = tiny_model()
    opt = adamw(model, fused=fused)
    data = batches(9)
    inf_steps = {5}
    history: list[float] = []
    for i, (x, y) in enumerate(data):
        before = scaler.get_scale()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y) * (math.inf if i in inf_steps else 1.0)
        scaler.scale(loss).backward()
        # the true amax of the unscaled gradient, from the scaled one (the scale is a power of two)
        true_amax = max(p.grad.abs().max().item() for p in model.parameters()) / before
        scaler.step(opt)
        scaler.update()
        stats = scaler.last_stats
        if i in inf_steps:
            assert stats.found_inf and scaler.get_scale() == before * 0.5
            continue
        assert stats.grad_amax == pytest.approx(true_amax, rel=1e-6)
        history = (history + [stats.grad_amax])[-3:]
        assert scaler.get_scale() == _expected_amax_scale(history, 2.0)
        assert scaler.get_scale() * max(history) <= FP16_MAX / 4


# ---------------------------------------------------------------- statistics the rules read
@pytest.mark.parametrize("keep", [False, True], ids=["per-tensor", "flat-copy"])
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_collected_amax_and_rms_are_those_of_the_unscaled_gradients(fused, keep):
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**10, collect_stats=True)
    scaler.grads.keep_abs = keep
    model = tiny_model()
    opt = adamw(model, fused=fused)
    (x, y), (x2, y2) = batches(2)
    opt.zero_grad()
    scaler.scale(forward_loss(model, x, y)).backward()
    grads = torch.cat([p.grad.reshape(-1) / 2.0**10 for p in model.parameters()])
    scaler.step(opt)
    scaler.update()
    stats = scaler.last_stats
    assert stats.grad_amax == pytest.approx(grads.abs().max().item(), rel=1e-6)
    assert stats.grad_rms == pytest.approx(grads.square().mean().sqrt().item(), rel=1e-5)

    opt.zero_grad()
    scaler.scale(forward_loss(model, x2, y2, inf=True)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_stats.found_inf
    assert not math.isfinite(scaler.last_stats.grad_amax)


def test_amax_history_skips_the_rms_pass_unless_asked():
    model = tiny_model()
    ((x, y),) = batches(1)
    lean = autoscale.get_scaler("amax-history", device="cpu")
    full = autoscale.get_scaler("amax-history", device="cpu", collect_stats=True)
    plain = autoscale.get_scaler("torch", device="cpu")
    for scaler in (lean, full, plain):
        assert run(model, adamw(model), scaler, [(x, y)]).skipped == []
    assert math.isfinite(lean.last_stats.grad_amax) and math.isnan(lean.last_stats.grad_rms)
    assert math.isfinite(full.last_stats.grad_rms) and full.last_stats.grad_rms > 0
    assert math.isnan(plain.last_stats.grad_amax) and math.isnan(plain.last_stats.grad_rms)
    plain.collect_stats = True  # switching statistics on later collects all of them
    run(model, adamw(model), plain, [(x, y)])
    assert math.isfinite(plain.last_stats.grad_amax) and math.isfinite(plain.last_stats.grad_rms)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_grad_abs_is_the_unscaled_gradients_of_this_step_only(fused):
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**10, collect_stats=True)
    model = tiny_model()
    opt = adamw(model, fused=fused)
    run(model, opt, scaler, batches(1))
    assert (
        scaler.grads.grad_abs(opt, scaler.steps) is None
    )  # not kept unless asked for: the per-tensor path is cheaper
    scaler.grads.keep_abs = True
    for x, y in batches(2):
        opt.zero_grad()
        scaler.scale(forward_loss(model, x, y)).backward()
        assert (
            scaler.grads.grad_abs(opt, scaler.steps) is None
        )  # nothing collected for this step yet
        scaler.unscale_(opt)
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).abs()
        assert torch.equal(scaler.grads.grad_abs(opt, scaler.steps), grads)
        scaler.step(opt)
        scaler.update()
        assert (
            scaler.grads.grad_abs(opt, scaler.steps) is None
        )  # the next step's gradients are not these
        assert scaler.grads.grad_norm(opt, scaler.steps) is None
    if fused:  # without unscale_, the fused kernel unscales: the statistics' copy is scaled
        opt.zero_grad()
        scaler.scale(forward_loss(model, x, y)).backward()
        scaler.step(opt)
        assert scaler.last_stats is not None and scaler.grads.grad_abs(opt, scaler.steps) is None
        scaler.update()


# ---------------------------------------------------------------- amax-cap
def test_amax_cap_hand_computed():
    scaler = autoscale.get_scaler(
        "amax-cap", device="cpu", history_len=2, margin=2.0, growth_interval=4, probe_after=2
    )
    bad_batch = dict(loss=math.inf, loss_seen=True)
    spike = dict(loss=0.5, loss_seen=True)  # a finite loss: the gradients overflowed
    mid = math.sqrt(2.0**39)  # the geometric midpoint of 2^19 and 2^20
    steps = [  # (found_inf, amax, loss of the batch) -> scale
        ((F, 1.0, {}), 2.0**13),  # no cap yet: amax-history's 2^13 (log2(65504) - 2 = 13.9997)
        ((T, math.inf, bad_batch), 2.0**13),  # the loss itself was inf: fails at any scale, kept
        ((F, 0.01, {}), 2.0**13),  # history [1, .01]
        ((F, 0.01, {}), 2.0**20),  # history [.01, .01]: 20.64
        ((T, math.inf, spike), 2.0**19),  # a gradient overflow at 2^20: cap 2^19
        ((F, 0.01, {}), 2.0**19),  # under a cap the amax keeps no margin: 2^22; the cap rules
        ((F, 1.0, {}), 2.0**15),  # clean 2: the probe, cap 2^19.5; amax 1.0 wants 2^15
        ((F, 0.01, {}), 2.0**15),  # history [1, .01]
        ((F, 0.01, {}), mid),  # the probe is on; the gap to 2^20 is half a bit: no more probes
        ((T, math.inf, spike), 2.0**19),  # the probe overflowed: back to the clean 2^19, not /2
        ((F, 0.01, {}), 2.0**19),
        ((F, 0.01, {}), 2.0**19),  # clean 2: the gap to 2^19.5 is half a bit: no probe
        ((F, 0.01, {}), 2.0**19),
        ((F, 0.01, {}), 2.0**20),  # clean 4: growth, as torch's
        ((T, math.inf, {}), 2.0**19),  # no loss seen: a gradient overflow; back to the clean level
    ]
    scale = scaler.get_scale()
    for i, ((found, amax, loss), expected) in enumerate(steps):
        stats = StepStats(i, scale, found, grad_amax=amax, **loss)
        scale = scaler.rule.next_scale(scale, stats)
        assert scale == expected, f"step {i}"
    assert scaler.rule.state() == {
        "history": [0.01, 0.01],
        "cap": 2.0**19,
        "clean": 0,
        "overflowed": 2.0**20,
        "safe": 0.0,
    }


def test_amax_cap_probes_only_below_a_scale_that_overflowed():
    """After a growth nothing has overflowed above the cap: no probe (a probe toward an unknown
    boundary would be a jump to infinity), and the cap holds."""
    rule = autoscale.get_scaler("amax-cap", device="cpu", growth_interval=3, probe_after=1).rule
    scale = rule.next_scale(2.0**10, StepStats(0, 2.0**10, True, grad_amax=math.inf))
    scales = [scale]
    for i in range(1, 7):  # tiny gradients: amax-history alone would want 2^25
        scale = rule.next_scale(scale, StepStats(i, scale, False, grad_amax=1e-3))
        scales.append(scale)
    # backoff 2^9; probe 2^9.5 (the gap to 2^10 is then half a bit); growth to 2^10.5 at clean 3
    assert scales[:5] == [2.0**9, math.sqrt(2.0**19), math.sqrt(2.0**19), math.sqrt(2.0**19),
                          math.sqrt(2.0**21)]  # fmt: skip
    assert scales[5:] == [math.sqrt(2.0**21)] * 2 and math.isfinite(rule.cap)  # no probe at 5
    assert math.isinf(rule.overflowed) and rule.safe == math.sqrt(2.0**19)


def test_amax_cap_keeps_its_scale_on_batches_that_fail_at_any_scale():
    """Real steps: a batch whose loss is inf changes nothing (torch's rule would halve), and the
    state survives a checkpoint round trip."""
    after, scaler = drive("amax-cap", [F, F, T, F, T, F], init_scale=2.0**8)
    assert after[1] == after[2] and after[3] == after[4]  # the inf-loss steps kept the scale
    assert math.isinf(scaler.rule.cap)  # no gradient overflow: no cap
    fresh = autoscale.get_scaler("amax-cap", device="cpu")
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.rule.state() == scaler.rule.state() and fresh.get_scale() == scaler.get_scale()
    with pytest.raises(ConfigError, match="state 'cap'"):
        fresh.rule.load_state({"history": [], "cap": -1.0, "clean": 0})
    with pytest.raises(ConfigError, match="state 'safe'"):
        fresh.rule.load_state({"history": [], "cap": None, "safe": "x"})


# ---------------------------------------------------------------- amax-loss
def test_amax_loss_hand_computed():
    """The guard's limit, a guarded overflow (raises the amax per loss, keeps the cap), and the
    cap's regrowth whose wait doubles after each probe that overflows."""
    rule = autoscale.get_scaler(
        "amax-loss", device="cpu", history_len=1, probe_after=1, growth_interval=4
    ).rule
    assert rule.guard_limit() is None  # nothing seen yet: no guard
    s = rule.next_scale(2.0**10, StepStats(0, 2.0**10, False, grad_amax=2.0**-4, loss=2.0**-8,
                                           loss_seen=True))  # fmt: skip
    assert s == 2.0**17  # no cap yet: amax-history's floor(log2(65504 / 2^-4) - 2) = 17
    # amax per unit of loss 2^4; limit = 65504 * 2^-1 / 2^4
    assert rule.guard_limit() == FP16_MAX / 2.0**5
    # a guarded step (its scale lowered below the set one) that overflowed anyway
    s2 = rule.next_scale(2.0**6, StepStats(1, 2.0**6, True, grad_amax=math.inf, loss=2.0**2,
                                           loss_seen=True, guarded=True))  # fmt: skip
    assert s2 == s and math.isinf(rule.cap)  # the set scale and the cap stay
    assert max(rule.ratios) == 2.0 * FP16_MAX / (2.0**6 * 2.0**2)  # at least this much room
    # an unguarded gradient overflow caps as amax-cap does; probes then double their wait
    s3 = rule.next_scale(s, StepStats(2, s, True, grad_amax=math.inf, loss=1.0, loss_seen=True))
    assert s3 == s / 2 == rule.cap and rule.wait == 1
    tiny = dict(grad_amax=2.0**-20, loss=2.0**-24, loss_seen=True)
    s4 = rule.next_scale(s3, StepStats(3, s3, False, **tiny))  # clean 1: the half-bit probe
    assert s4 == math.sqrt(s3 * s)
    s5 = rule.next_scale(s4, StepStats(4, s4, True, grad_amax=math.inf, loss=1.0, loss_seen=True))
    assert s5 == s3 and rule.wait == 2  # the probe overflowed: back, and twice the wait
    s6 = rule.next_scale(s5, StepStats(5, s5, False, **tiny))
    assert s6 == s5  # clean 1 of 2: no probe yet (within half a bit of 2^17: none due anyway)
    s7 = rule.next_scale(s6, StepStats(6, s6, False, **tiny))
    assert s7 == 2 * s5  # clean 2: the boundary is known within half a bit, so it regrows
    state = rule.state()
    assert state["wait"] == 2 and state["base"] == s7
    fresh = autoscale.get_scaler("amax-loss", device="cpu").rule
    fresh.load_state(state)
    assert fresh.state() == state and fresh.guard_limit() == rule.guard_limit()
    with pytest.raises(ConfigError, match="state 'ratios'"):
        fresh.load_state({**state, "ratios": [0.0]})
    with pytest.raises(ConfigError, match="guard_margin"):
        autoscale.get_scaler("amax-loss", device="cpu", guard_margin=-1)


def test_guarded_scale_is_the_host_twin_of_the_device_guard():
    """The environments' guarded_scale and the scaler's device computation agree."""
    from autoscale.scalers.loss_guard import guarded_scale

    cases = [1e-9, 1e-3, 0.7, 1.0, 5.0, 1e3, 1e6, 1e12, 0.0, math.inf, -4.0, math.nan]
    for loss in cases:  # a fresh scaler each: a step's guard is its own
        scaler = autoscale.get_scaler("amax-loss", device="cpu", init_scale=2.0**12, min_scale=1.0)
        scaler.rule.ratios.append(3.0)  # gradient amax 3x the loss
        limit = scaler.rule.guard_limit()
        scaler.scale(torch.tensor(loss))
        device = scaler._scale.item()  # GradScaler's scale tensor: what multiplied the loss
        assert device == guarded_scale(2.0**12, loss, limit, 1.0), loss
    assert guarded_scale(2.0**12, 1e12, limit, 1.0) == 1.0  # never below the minimum
    assert guarded_scale(2.0**12, 1.0, None, 1.0) == 2.0**12  # no guard


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_amax_loss_lowers_a_spikes_scale_for_that_step_only(fused):
    """Real steps: a loss 2^12 times the usual gets a lower scale on the device, the step is not
    skipped, its gradients are unscaled by the scale it used, the record says so, and the next
    step is back at the set scale."""
    scaler = autoscale.get_scaler("amax-loss", device="cpu", init_scale=2.0**10)
    model = tiny_model()
    opt = adamw(model, fused=fused)
    data = batches(6)
    for x, y in data[:4]:  # quiet steps: the rule learns the amax per unit of loss
        opt.zero_grad()
        scaler.scale(forward_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_stats.guarded and not scaler.last_stats.found_inf
    set_scale = scaler.get_scale()
    x, y = data[4]
    ref = torch.autograd.grad(forward_loss(model, x, y) * 2.0**12, list(model.parameters()))
    opt.zero_grad()
    spike = forward_loss(model, x, y) * 2.0**12
    scaled = scaler.scale(spike)
    step_scale = scaled.item() / spike.item()
    assert step_scale < set_scale  # lowered for this step
    scaled.backward()
    scaler.step(opt)
    scaler.update()
    stats = scaler.last_stats
    assert stats.guarded and not stats.found_inf and stats.scale == step_scale
    assert stats.grad_amax == pytest.approx(max(g.abs().max().item() for g in ref), rel=1e-2)
    assert scaler._scale.item() == scaler.get_scale()  # the tensor is back at the set scale
    opt.zero_grad()
    x, y = data[5]
    scaled = scaler.scale(forward_loss(model, x, y))
    assert scaled.item() / forward_loss(model, x, y).item() == pytest.approx(scaler.get_scale())


def test_amax_loss_guards_from_the_first_micro_batch():
    """With gradient accumulation every micro-batch takes the first one's scale (the gradients
    accumulate under one scale)."""
    scaler = autoscale.get_scaler("amax-loss", device="cpu", init_scale=2.0**10)
    scaler.rule.ratios.append(1.0)
    # limit 65504 / 2 (one bit of margin), just under 2^15: 2^floor(log2(limit / 2^8)) = 2^6
    first = scaler.scale(torch.tensor(2.0**8)).item() / 2.0**8
    assert first == 2.0**6
    second = scaler.scale(torch.tensor(2.0**-8)).item() / 2.0**-8  # would want the set 2^10
    assert second == first


def test_a_guard_floor_keeps_near_zero_losses_from_teaching_the_guard():
    """A loss that cancels to near zero while its gradients do not teaches a guard with a floor
    nothing; the floor follows the last guard_history steps' largest |loss|; its state loads,
    and a state from before the floor (ratios alone) counts every ratio."""
    from autoscale.scalers.rules.guard import LEARNED, LossGuard

    def step(i, loss, amax=1e-3):
        return StepStats(i, 2.0**16, False, amax, amax / 10, loss, loss_seen=True)

    plain, floored = LossGuard(4, 1.0), LossGuard(4, 1.0, guard_floor=12.0)
    for g in (plain, floored):
        assert g.observe(2.0**16, step(0, 1e-2)) == LEARNED
    assert plain.observe(2.0**16, step(1, 1e-8)) == LEARNED  # amax per |loss| 1e5
    assert floored.observe(2.0**16, step(1, 1e-8)) is None  # 2^20 below 1e-2: a cancellation
    assert plain.guard_limit() == pytest.approx(FP16_MAX / 2 / 1e5)
    assert floored.guard_limit() == pytest.approx(FP16_MAX / 2 / 0.1)  # the 1e-2 step alone
    assert floored.observe(2.0**16, step(2, 1e-2 * 2.0**-11)) == LEARNED  # within 12 bits
    for i in range(3, 7):  # four steps of small losses: the 1e-2 step leaves the window
        floored.observe(2.0**16, step(i, 1e-9, amax=1e-6))
    assert max(floored.losses) == 1e-9
    # the lessons learned at 1e-2 and 1e-2 * 2^-11 are now far above the window's losses: they
    # count (a floor only drops lessons learned far *below* the recent losses)
    assert floored.guard_limit() is not None
    state = floored.state()
    fresh = LossGuard(4, 1.0, guard_floor=12.0)
    fresh.load_state(state, "test")
    assert fresh.state() == state and fresh.guard_limit() == floored.guard_limit()
    old = LossGuard(4, 1.0, guard_floor=12.0)
    old.load_state({"ratios": [0.5, 2.0]}, "test")  # a checkpoint from before the floor
    assert old.guard_limit() == FP16_MAX / 2 / 2.0
    with pytest.raises(ConfigError, match="one \\|loss\\| per ratio"):
        old.load_state({"ratios": [0.5], "ratio_losses": [1.0, 2.0]}, "test")
    with pytest.raises(ConfigError, match="guard_floor"):
        LossGuard(4, 1.0, guard_floor=-1.0)
