"""The long runs' precision measure: gradient elements kept at fp16 precision, of those an fp32
backward of the same step leaves non-zero (real steps on tiny models)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import autoscale
from autoscale.envs.suite import load_spec
from autoscale.selection import suite_eval as ev
from autoscale.training import TrainingRun

ROOT = Path(__file__).resolve().parents[2]


def _factories(**named):
    return {
        name: (lambda rule=rule, kw=kw: autoscale.get_scaler(rule, device="cpu", **kw))
        for name, (rule, kw) in named.items()
    }


@pytest.mark.parametrize(
    ("member", "rule", "kw", "steps"),
    [
        ("mlp/bad-batches", "torch", {}, 12),
        pytest.param(
            "gpt2-tiny/rl-finetune",
            "amax-loss",
            {"probe_after": 8, "guard_floor": 12},
            5,
            marks=pytest.mark.slow,  # a transformer's run: seconds
        ),
    ],
)
def test_the_reference_backward_leaves_the_run_where_it_was(member, rule, kw, steps):
    """A run that takes an fp32 reference backward before its steps takes the same steps as one
    that does not (bit for bit on CPU): the measure does not change what it measures. Also where
    the scenario samples rollouts at the step and keeps them (rl-finetune), under a rule with
    memory."""
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    spec = suite.member(member).workload.replace(seed=3)
    plain = TrainingRun(spec, autoscale.get_scaler(rule, device="cpu", **kw))
    watched = TrainingRun(spec, autoscale.get_scaler(rule, device="cpu", **kw))
    params = [p for p in watched.model.parameters() if p.requires_grad]
    plain.run(steps)
    for _ in range(steps):
        live = ev.reference_live(watched, params)
        assert len(live) == len(params) and all(m.shape == p.shape for m, p in zip(live, params))
        watched.step()

    def same(run):  # repr: a skipped step's NaN does not equal itself
        return [repr(r.to_dict() | {"wall_s": 0}) for r in run.records]

    assert same(watched) == same(plain)
    assert watched.eval_loss() == plain.eval_loss()
    for a, b in zip(watched.model.state_dict().values(), plain.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_rollout_the_step_samples_is_sampled_as_the_step_samples_it(monkeypatch):
    """rl-finetune samples a rollout at each round's first step, under fp16 autocast; the
    reference backward trains on that rollout, not on one it samples itself in fp32."""
    from autoscale.training.rl_finetune import RLFinetune

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    spec = suite.member("gpt2-tiny/rl-finetune").workload.replace(seed=3)
    run = TrainingRun(spec, autoscale.get_scaler("torch", device="cpu"))
    drawn = []
    real = RLFinetune._rollout

    def rollout(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        drawn.append((torch.is_autocast_enabled("cpu"), out["tokens"].clone()))
        return out

    monkeypatch.setattr(RLFinetune, "_rollout", rollout)
    params = [p for p in run.model.parameters() if p.requires_grad]
    ev.reference_live(run, params)  # step 0: a round's first step
    run.step()
    assert len(drawn) == 2, "the reference and the step each sample once"
    (ref_autocast, ref_tokens), (step_autocast, step_tokens) = drawn
    assert ref_autocast and step_autocast
    assert torch.equal(ref_tokens, step_tokens)


@pytest.mark.slow  # long runs of a conv net with the reference backward: seconds
def test_exact_zeros_are_the_models_and_flushed_ones_the_scales():
    """On cnn/token-sum many gradient elements are zero in exact arithmetic too (ReLUs off for
    the whole batch): torch keeps nearly all of the others, so they do not count against it,
    while a share of all elements would. A scale of 2^-24 flushes nearly every gradient element
    to zero: kept falls to almost nothing, and the long runs' verdict names it."""
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    member = "cnn/token-sum"
    runs = ev.long_runs(
        suite,
        [member],
        _factories(torch=("torch", {}), low=("static", {"init_scale": 2.0**-24})),
        steps=30,
    )
    torch_run, low = runs[member]["torch"], runs[member]["low"]
    numel = sum(p.numel() for p in TrainingRun(suite.member(member).workload).model.parameters())
    exact = ev.structural_share(torch_run)
    assert exact > 0.05, exact  # the model's own zeros
    assert ev.kept_share(torch_run) > 0.95
    applied = [
        (n, r.precision_loss)
        for n, r in zip(torch_run["nonzero"], torch_run["records"], strict=True)
        if n >= 0
    ]
    of_all = math.fsum(n * (1 - pl) / numel for n, pl in applied) / len(applied)
    assert of_all < ev.kept_share(torch_run) - exact / 2  # a share of all counts them
    assert ev.kept_share(low) < 0.2
    harm = ev.long_harm(runs, "low")[member]
    assert any("gradient elements at fp16 precision" in why for why in harm), harm
    assert ev.long_harm(runs, "torch")[member] == []


def test_every_window_with_an_applied_step_is_sampled():
    """One sampled step per window of REFERENCE_EVERY; a skipped sample moves to the next step,
    so a short run whose first steps overflow is still measured."""
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    member = "mlp/token-sum"  # its first steps overflow at torch's initial 2^16
    runs = ev.long_runs(suite, [member], _factories(torch=("torch", {})), steps=24)
    run = runs[member]["torch"]
    sampled = [i for i, k in enumerate(run["kept"]) if math.isfinite(k)]
    windows = {i // ev.REFERENCE_EVERY for i, n in enumerate(run["nonzero"]) if n >= 0}
    assert {i // ev.REFERENCE_EVERY for i in sampled} == windows
    assert len(sampled) == len(windows) == 3  # one in each
    assert run["nonzero"][0] == -1 and sampled[0] > 0  # the skipped first step moved it on


def test_runs_drawn_not_judged_take_no_reference():
    """``reference=False`` (runs that are only drawn): no sample, the same steps."""
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    member = "mlp/token-sum"
    fs = _factories(torch=("torch", {}))
    plain = ev.long_runs(suite, [member], fs, steps=12, reference=False)[member]["torch"]
    judged = ev.long_runs(suite, [member], fs, steps=12)[member]["torch"]
    assert all(math.isnan(k) for k in plain["kept"]) and math.isnan(ev.kept_share(plain))
    assert math.isfinite(ev.kept_share(judged))
    timeless = {"wall_s": 0.0, "useful_steps_per_s": 0.0}
    cards = [dataclasses.replace(r["card"], **timeless) for r in (plain, judged)]
    assert repr(cards[0]) == repr(cards[1])
