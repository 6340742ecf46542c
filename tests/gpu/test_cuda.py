"""CUDA: parity with GradScaler, fused optimizers with inf and NaN, host syncs, device-to-host
reads, and the environment and a search step on GPT-2 124M (skipped without CUDA)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

import autoscale
from tests.gpu.helpers import count_syncs

DEV = "cuda"


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)
    ).to(DEV)


def data(n: int, seed: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [
        (torch.randn(32, 64, generator=g).to(DEV), torch.randn(32, 16, generator=g).to(DEV))
        for _ in range(n)
    ]


def step(model, opt, scaler, x, y, poison: float = 1.0, unscale: bool = False) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.float16):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y) * poison
    scaler.scale(loss).backward()
    if unscale:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale-clip"])
def test_torch_rule_is_bit_identical_to_gradscaler_on_cuda_fp16(fused, unscale):
    a = mlp()
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=fused)
    ours = autoscale.get_scaler("torch", device=DEV, init_scale=2.0**10, growth_interval=4)
    ref = torch.amp.GradScaler(DEV, init_scale=2.0**10, growth_interval=4)
    for i, (x, y) in enumerate(data(40)):
        poison = math.inf if i % 7 == 3 else 1.0
        step(a, oa, ours, x, y, poison, unscale)
        step(b, ob, ref, x, y, poison, unscale)
        assert ours.get_scale() == ref.get_scale(), f"step {i}"
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert ours.skipped == sum(1 for i in range(40) if i % 7 == 3)


@pytest.mark.parametrize("poison", [math.inf, math.nan], ids=["inf", "nan"])
def test_fused_adamw_skips_inf_and_nan_while_statistics_are_collected(poison):
    """The fused path derives found-inf from the gradient amax it reads anyway: NaN must count."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = autoscale.get_scaler("amax-history", device=DEV, init_scale=2.0**10)
    assert scaler.collect_stats
    for i, (x, y) in enumerate(data(12)):
        before = [p.detach().clone() for p in model.parameters()]
        bad = i in (3, 8)
        step(model, opt, scaler, x, y, poison if bad else 1.0)
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert same == bad, f"step {i}: {'stepped over' if bad else 'skipped'} the poisoned batch"
        assert scaler.last_stats.found_inf == bad and scaler.step_was_skipped == bad
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.skipped == 2


FIXTURE_NOW = str(
    Path(__file__).resolve().parents[1] / "scalers" / "fixtures" / "policies" / "fixture-neural-now"
)  # a neural policy acting at scale time: it decides on the device, from the loss


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
@pytest.mark.parametrize("rule", ["torch", "amax-history", "deepspeed", "amax-loss", FIXTURE_NOW])
def test_host_syncs_per_step_are_gradscalers_plus_at_most_one(rule, fused):
    a, b = mlp(), mlp()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=fused)
    ours = autoscale.get_scaler(rule, device=DEV)
    ref = torch.amp.GradScaler(DEV)
    batches = data(6)
    for x, y in batches[:2]:  # warm up: lazy state, the scale tensor, the handshake
        step(a, oa, ours, x, y)
        step(b, ob, ref, x, y)
    for x, y in batches[2:]:
        mine = count_syncs(lambda x=x, y=y: step(a, oa, ours, x, y))
        theirs = count_syncs(lambda x=x, y=y: step(b, ob, ref, x, y))
        assert mine <= theirs + 1, (mine, theirs)


def test_a_host_scale_with_cuda_gradients_reads_found_inf_after_it_lands():
    """The scale tensor on the CPU, gradients on CUDA: the found-inf flags come back to the host;
    a non-blocking copy read before it lands would miss overflows now and then."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**10)
    inf_steps = {i for i in range(200) if i % 3 == 1}
    skipped = []
    for i, (x, y) in enumerate(data(200)):
        before = scaler.skipped
        step(model, opt, scaler, x, y, math.inf if i in inf_steps else 1.0)
        if scaler.skipped > before:
            skipped.append(i)
    assert set(skipped) == inf_steps


def test_the_env_and_a_search_step_on_gpt2_124m(tmp_path):
    import math as m

    import optuna

    from autoscale.envs import LossScaleEnv
    from autoscale.envs.episodes import drive_episode, scaler_for
    from autoscale.envs.suite import as_suite
    from autoscale.search.bench import ReplayBench
    from autoscale.search.budget import Ledger
    from autoscale.search.loop import TrialLoop
    from autoscale.search.plan import shape_suite
    from autoscale.search.space import parametric_families
    from autoscale.search.storage import artifact_store, open_storage
    from autoscale.search.traces import load_traces
    from autoscale.search.trials import ParametricObjective, TrialRecorder
    from autoscale.search.workload import base_spec

    spec = base_spec(model="gpt2")
    spec = spec.__class__(
        **{**spec.__dict__, "workload": spec.workload.replace(device="cuda", init="random")}
    )
    suite = shape_suite(as_suite(spec), 16, 1, 1)
    member = suite.members[0]
    env = LossScaleEnv(member, instances="test")
    card, records = drive_episode(env, scaler_for("amax-history", member), env.instances[0].name)
    assert card.steps == 16 and m.isfinite(card.eval_loss) and len(records) == 16
    assert env.run.device.type == "cuda"

    traces, stats = load_traces(suite, tmp_path, 32, cost=lambda w, n: 0.0, stop_at=m.inf)
    assert stats["recorded"] == 2
    bench = ReplayBench(suite, traces)
    ledger = Ledger()
    recorder = TrialRecorder(bench, artifact_store(tmp_path), ledger, tmp_path, warn=print)
    study = optuna.create_study(storage=open_storage(f"sqlite:///{tmp_path / 's.db'}"))
    counts = {"complete": 0, "pruned": 0, "failed": 0}
    TrialLoop(study, ledger, worker="gpu:1", warn=print, counts=counts, n_trials=2).run(
        ParametricObjective(bench, recorder, ledger, parametric_families()), m.inf
    )
    assert counts["failed"] == 0 and counts["complete"] + counts["pruned"] == 2


def test_a_scale_time_policy_decides_on_the_device_as_on_the_host():
    """The device path (first layer split, the loss's half on the GPU) picks the scale the host
    path picks from the same state and loss."""
    scaler = autoscale.get_scaler(FIXTURE_NOW, device=DEV, init_scale=2.0**10)
    rule, bounds = scaler.rule, scaler.controller.bounds
    model, picked = mlp(), []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i, (x, y) in enumerate(data(24)):
        base = scaler.get_scale()
        for loss in (0.5 + i, 3e3, 1e-6, math.inf):
            host = rule.step_scale(base, loss, bounds)
            dev = rule.device_bits(base, torch.tensor(loss, device=DEV, dtype=torch.float64))
            assert bounds.clamp(base * 2.0 ** float(dev)) == host, (i, loss)
            picked.append(host / base)
        step(model, opt, scaler, x, y)
    assert len(set(picked)) > 1


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
def test_a_loss_spike_is_skipped_on_the_device(fused):
    """``amax-loss`` with ``spike_bits`` on CUDA: the spike test a device flag merged into the
    found-inf flag (the one the fused kernel reads), no host sync for it; two micro-batches a
    step, the first's loss x 8000 at step 30, the second's at 55: those two steps are skipped as
    spikes (the step's mean loss decides, as on a CPU: tests/scalers/test_spikes.py), and no
    other step is skipped."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = autoscale.get_scaler("amax-loss", device=DEV, spike_bits=8.0)
    skipped, spiked = [], []
    for i, (x, y) in enumerate(data(80)):
        opt.zero_grad(set_to_none=True)
        for half, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            with torch.autocast(DEV, dtype=torch.float16):
                out = model(xs)
            loss = torch.nn.functional.mse_loss(out.float(), ys) / 2
            if (i, half) in ((30, 0), (55, 1)):
                loss = loss * 8000.0
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += [i] if scaler.step_was_skipped else []
        spiked += [i] if scaler.last_stats.spiked else []
    assert spiked == [30, 55] and skipped == [30, 55]
