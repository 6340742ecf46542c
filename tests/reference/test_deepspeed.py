"""Our ``deepspeed`` rule against DeepSpeed's own ``DynamicLossScaler``, and the ``fp16`` block
autoscale exports against DeepSpeed's config parser and loss-scaler factory.

DeepSpeed has two fp16 paths: under ZeRO (stages 1-3) the optimizer takes its scaler from
``CreateLossScaler`` (``DynamicLossScaler``: hysteresis, abort at the minimum); without ZeRO,
``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` run their own ``_update_scale`` on a
``LossScaleConfig``, which halves on every overflow and ignores ``hysteresis`` and
``consecutive_hysteresis``. Both are run here.
"""

from __future__ import annotations

import pytest
import torch

from autoscale.errors import MinimumLossScaleError
from autoscale.integrations.deepspeed import deepspeed_config
from autoscale.scalers import make_scaler
from tests.reference.helpers import (
    TOP,
    describe_difference,
    events,
    first_difference,
    growth_steps,
    our_scales,
    sequences,
)
from tests.scalers.helpers import adamw, batches, run, tiny_model

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[reference]'")
from deepspeed.runtime.fp16.loss_scaler import (  # noqa: E402
    CreateLossScaler,
    DynamicLossScaler,
    LossScaler,
)

pytestmark = pytest.mark.usefixtures("deepspeed_group")

# DynamicLossScaler's arguments: (init_scale, scale_window, delayed_shift, consecutive_hysteresis,
# min_scale); its scale_factor is fixed at 2. The first is its fp16 config's defaults.
CASES = {
    "defaults": (2.0**16, 1000, 2, False, 1.0),
    "window100-hysteresis1": (2.0**16, 100, 1, False, 1.0),
    "window250-hysteresis4-consecutive": (2.0**20, 250, 4, True, 0.25),
    "window500-hysteresis3-min16": (2.0**24, 500, 3, False, 16.0),
    "window150-hysteresis2-consecutive-min1": (2.0**10, 150, 2, True, 1.0),
}


def deepspeed_fp16_config(rule: str, params: dict) -> dict:
    """The ``fp16`` block autoscale exports for ``rule`` with ``params``."""
    return deepspeed_config(rule, **params)["fp16"]


def upstream(overflows, init, window, hysteresis, consecutive, min_scale, raise_at_min=False):
    """DeepSpeed's scale after each step (with ``raise_at_min``, its abort at the minimum
    propagates)."""
    s = DynamicLossScaler(
        init_scale=init,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=raise_at_min,
    )
    return drive(s, overflows)


def drive(s, overflows):
    out = []
    for flag in overflows:
        s.update_scale(bool(flag))
        out.append(float(s.cur_scale))
    return out


def ours(overflows, init, window, hysteresis, consecutive, min_scale, max_scale=TOP):
    params = {
        "loss_scale_window": window,
        "hysteresis": hysteresis,
        "consecutive_hysteresis": consecutive,
    }
    return our_scales(
        "deepspeed", params, overflows, init_scale=init, min_scale=min_scale, max_scale=max_scale
    )


@pytest.mark.slow  # 10,000-step sequences x 10 seeds
@pytest.mark.parametrize("case", list(CASES))
def test_same_scale_sequence_as_dynamic_loss_scaler(case):
    args = CASES[case]
    seen = {"up": 0, "down": 0, "held_on_overflow": 0, "at_min": 0}
    for name, overflows in sequences():
        theirs = upstream(overflows, *args)
        assert max(theirs) < TOP  # our max_scale never engaged: a pure comparison
        mine = ours(overflows, *args)
        assert mine == theirs, f"{case} {name}: " + describe_difference(mine, theirs, overflows)
        for k, v in events(theirs, args[0], overflows).items():
            seen[k] += v
        seen["at_min"] += theirs.count(args[4])
    # every branch was compared: growth, backoff, overflows absorbed, the floor
    assert all(v > 0 for v in seen.values()), seen


def test_the_minimum_aborts_deepspeed_and_ours_only_with_raise_at_min():
    """DeepSpeed's DynamicLossScaler (raise_error_at_min_scale=True, what CreateLossScaler builds)
    raises at an overflow at the minimum that it would answer by lowering the scale; ours keeps
    the minimum and goes on, unless raise_at_min=True, which raises at that same step."""
    init, window, hysteresis, min_scale = 8.0, 1000, 2, 1.0
    overflows = [True, True, False, True, True, False, True, False, True]
    # hysteresis spent, 8->4, clean, 4->2, 2->1 (the minimum), clean, overflow at the minimum
    s = DynamicLossScaler(init, window, min_scale, hysteresis, False, raise_error_at_min_scale=True)
    scales, abort = [], None
    for i, flag in enumerate(overflows):
        try:
            s.update_scale(flag)
        except Exception as exc:
            assert "Current loss scale already at minimum" in str(exc)
            abort = i
            break
        scales.append(float(s.cur_scale))
    assert abort == 6 and scales == [8.0, 4.0, 4.0, 2.0, 1.0, 1.0]
    mine = ours(overflows, init, window, hysteresis, False, min_scale)
    assert mine[:abort] == scales and mine[abort:] == [1.0, 1.0, 1.0]  # stays at the minimum

    # the same steps trained for real: raise_at_min=True raises at DeepSpeed's step, not before
    scaler = make_scaler(
        "deepspeed", device="cpu", init_scale=init, min_scale=min_scale, raise_at_min=True
    )
    model = tiny_model()
    opt = adamw(model)
    inf_steps = [i for i, f in enumerate(overflows) if f]
    done = []
    with pytest.raises(MinimumLossScaleError, match="already at minimum"):
        run(model, opt, scaler, batches(len(overflows)), inf_steps, each=done.append)
    assert done == list(range(abort))


def test_consecutive_hysteresis_at_the_minimum_absorbs_instead_of_aborting():
    """With consecutive_hysteresis a clean step refills the hysteresis, so an overflow at the
    minimum after it is absorbed: neither DeepSpeed nor ours (raise_at_min=True) raises. Without
    it, DeepSpeed aborts at that step."""
    overflows = [True, True, True, False, True, False, True]
    theirs = upstream(overflows, 4.0, 1000, 2, True, 1.0, raise_at_min=True)
    assert theirs == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert ours(overflows, 4.0, 1000, 2, True, 1.0) == theirs
    with pytest.raises(Exception, match="Current loss scale already at minimum"):
        upstream(overflows, 4.0, 1000, 2, False, 1.0, raise_at_min=True)
    scaler = make_scaler(
        "deepspeed",
        device="cpu",
        init_scale=4.0,
        min_scale=1.0,
        consecutive_hysteresis=True,
        raise_at_min=True,
    )
    model = tiny_model()
    trace = run(model, adamw(model), scaler, batches(len(overflows)), [0, 1, 2, 4, 6])
    assert trace.after == theirs and scaler.min_hits == 2


def test_deepspeed_grows_past_our_max_scale():
    """DeepSpeed has no ceiling; ours stops at max_scale (the only difference on a clean run),
    and backs off from there."""
    clean = [False] * 5000
    theirs = upstream(clean + [True], 2.0**16, 100, 1, False, 1.0)
    mine = ours(clean + [True], 2.0**16, 100, 1, False, 1.0, max_scale=2.0**40)
    cap = 2.0**40
    assert mine[:-1] == [min(t, cap) for t in theirs[:-1]]
    first = first_difference(mine, theirs)
    assert first == 24 * 100 + 100  # the 25th growth (2^16 -> 2^41) at step 2500
    assert theirs[first] == 2.0**41 and mine[first] == cap
    assert theirs[-1] == theirs[-2] / 2 and mine[-1] == cap / 2


# ------------------------------------------------------------------ the exported fp16 block
EXPORTED = {
    "deepspeed": {},
    "deepspeed-tuned": {"loss_scale_window": 300, "hysteresis": 3, "init_scale": 2.0**12},
    "deepspeed-consecutive": {"consecutive_hysteresis": True, "min_scale": 4.0},
    "torch": {"growth_interval": 500},
    "megatron": {},
    "megatron-tuned": {"growth_interval": 200, "hysteresis": 4, "min_scale": 2.0},
    "jmp": {"period": 400},
}


def parsed(fp16: dict):
    """The fp16 block through DeepSpeed's config parser, then its loss-scaler factory as the ZeRO
    optimizers call it (the engine's loss_scale(), dynamic_loss_scale() and
    dynamic_loss_scale_args())."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 1, "fp16": fp16})
    f = config.float16_config
    scaler = CreateLossScaler(
        dtype=torch.half,
        static_loss_scale=f.loss_scale,
        dynamic_scaling=f.loss_scale == 0,
        dynamic_loss_args=f.dynamic_loss_scale_args(),
    )
    return config, scaler


@pytest.mark.slow  # 10,000-step sequences
@pytest.mark.parametrize("case", list(EXPORTED))
def test_exported_block_builds_a_deepspeed_scaler_with_our_parameters(case):
    rule = case.split("-")[0]
    params = EXPORTED[case]
    s = make_scaler(rule, device="cpu", **params)
    fp16 = deepspeed_fp16_config(rule, params)
    assert deepspeed_config(rule, **params)["fp16"] == fp16  # the integration writes the same
    config, scaler = parsed(fp16)
    assert config.float16_config.enabled and isinstance(scaler, DynamicLossScaler)
    knobs = s.rule.params()
    window = {
        "deepspeed": lambda: knobs["loss_scale_window"],
        "torch": lambda: knobs["growth_interval"] - 1,  # see test_torch_window below
        "megatron": lambda: knobs["growth_interval"] - 1,
        "jmp": lambda: knobs["period"] - 1,
    }[rule]()
    expected = {
        "cur_scale": s.get_scale(),
        "scale_window": window,
        "delayed_shift": knobs.get("hysteresis", 1),
        "consecutive_hysteresis": knobs.get("consecutive_hysteresis", False),
        "min_scale": max(1.0, s.min_scale),  # DeepSpeed's min_loss_scale is an integer >= 1
        "scale_factor": 2.0,
        "raise_error_at_min_scale": True,
    }
    assert {k: getattr(scaler, k) for k in expected} == expected

    # and the scaler DeepSpeed built runs our deepspeed rule with those parameters, step for step
    for name, overflows in sequences()[:4]:
        theirs = drive(scaler_from(fp16), overflows)
        mine = ours(
            overflows,
            s.get_scale(),
            window,
            expected["delayed_shift"],
            expected["consecutive_hysteresis"],
            expected["min_scale"],
        )
        assert mine == theirs, f"{case} {name}: " + describe_difference(mine, theirs, overflows)
    if rule == "deepspeed":  # our deepspeed rule as configured is exactly what DeepSpeed runs
        knobs = {k: v for k, v in params.items() if k not in ("init_scale", "min_scale")}
        for _, overflows in sequences()[:4]:
            direct = our_scales(
                "deepspeed", knobs, overflows, init_scale=s.get_scale(), min_scale=s.min_scale
            )
            assert direct == drive(scaler_from(fp16), overflows)


def scaler_from(fp16: dict) -> DynamicLossScaler:
    _, scaler = parsed(fp16)
    scaler.raise_error_at_min_scale = False  # compare sequences past the minimum
    return scaler


def test_static_block_builds_a_static_scaler():
    fp16 = deepspeed_fp16_config("static", {"init_scale": 512.0})
    config, scaler = parsed(fp16)
    assert type(scaler) is LossScaler and not scaler.dynamic
    assert (
        scaler.cur_scale
        == 512.0
        == make_scaler("static", device="cpu", init_scale=512.0).get_scale()
    )
    scaler.update_scale(True)
    assert scaler.cur_scale == 512.0


def test_torch_window_differs_from_deepspeeds_after_the_first_growth():
    """DeepSpeed grows after window+1 clean steps, then every window; torch after
    growth_interval, then every growth_interval. The block's window (growth_interval - 1) gives
    the same first growth; each later growth of a clean stretch comes one step earlier."""
    g = 500
    fp16 = deepspeed_fp16_config("torch", {"growth_interval": g})
    clean = [False] * 2000
    theirs = drive(scaler_from(fp16), clean)
    mine = our_scales("torch", {"growth_interval": g}, clean, init_scale=2.0**16, min_scale=1.0)
    assert growth_steps(mine, 2.0**16) == [g - 1, 2 * g - 1, 3 * g - 1, 4 * g - 1]
    assert growth_steps(theirs, 2.0**16) == [g - 1, 2 * g - 2, 3 * g - 3, 4 * g - 4]
    assert first_difference(mine, theirs) == 2 * g - 2


def test_without_zero_deepspeed_ignores_hysteresis():
    """Without ZeRO, DeepSpeed's fp16 optimizers keep the scale in a LossScaleConfig built from
    the same block and halve on every overflow: the block of our deepspeed rule (hysteresis 2)
    runs there as our rule with hysteresis 1."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    fp16 = deepspeed_fp16_config("deepspeed", {"loss_scale_window": 200, "min_scale": 2.0})
    config, _ = parsed(fp16)
    f = config.float16_config
    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer):
        for name, overflows in sequences()[:3]:
            param = torch.nn.Parameter(torch.zeros(4, dtype=torch.half))
            opt = cls(
                torch.optim.SGD([param], lr=0.1),
                dynamic_loss_scale=f.loss_scale == 0,
                static_loss_scale=f.loss_scale,
                dynamic_loss_args=f.dynamic_loss_scale_args(),
                verbose=False,
            )
            theirs = []
            for flag in overflows:
                opt._update_scale(flag)
                theirs.append(float(opt.loss_scale_config.cur_scale))
            as_one = ours(overflows, 2.0**16, 200, 1, False, 2.0)
            assert as_one == theirs, f"{cls.__name__} {name}: " + describe_difference(
                as_one, theirs, overflows
            )
            as_block = ours(overflows, 2.0**16, 200, 2, False, 2.0)
            first = first_difference(as_block, theirs)
            assert first == overflows.index(True)  # the first overflow: ZeRO would absorb it
            assert theirs[first] == as_block[first] / 2


def test_deepspeed_engine_runs_the_exported_block(monkeypatch):
    """A real DeepSpeed engine (ZeRO stage 1, fp16) for a few steps with forced overflows: its
    loss scale follows our deepspeed rule. DeepSpeed trains fp16 only where its accelerator
    supports fp16 (CUDA, or a CPU with oneDNN fp16)."""
    import deepspeed

    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # what a launcher sets; the 1-rank group is up already
    window, hysteresis = 3, 2
    fp16 = deepspeed_fp16_config(
        "deepspeed",
        {"init_scale": 2.0**8, "loss_scale_window": window, "hysteresis": hysteresis},
    )
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "fp16": fp16,
    }
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    try:
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    except ValueError as exc:
        if "fp16 is not supported on your device" not in str(exc):
            raise
        from deepspeed.accelerator import get_accelerator

        pytest.skip(
            f"deepspeed.initialize raised ValueError('{exc}') from DeepSpeedEngine._do_sanity_check: "
            f"the {get_accelerator().device_name()} accelerator's is_fp16_supported() is not true "
            "(on CPU it needs oneDNN fp16, torch.ops.mkldnn._is_mkldnn_fp16_supported())"
        )
    overflows = [False, True, True, False, False, False, False, True, False, True, True, True]
    device = engine.device
    g = torch.Generator().manual_seed(0)
    scales = []
    for flag in overflows:
        x = torch.randn(8, 16, generator=g).to(device, torch.half)
        y = torch.randn(8, 8, generator=g).to(device, torch.half)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss * float("inf") if flag else loss)
        engine.step()
        scales.append(float(engine.optimizer.loss_scale))
    assert scales == ours(overflows, 2.0**8, window, hysteresis, False, 1.0)
