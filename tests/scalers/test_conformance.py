"""The drop-in contract, checked for every registered scaler (docs/design.md 3.1 and 3.4).

Parametrized at collection time over every registered rule, every shipped policy and the fixture
policies (``tests/scalers/helpers.py``): registering a rule or shipping a policy is enough for it
to be held to this suite.
"""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch

import autoscale
from autoscale.errors import MinimumLossScaleError
from tests.scalers.helpers import (
    FIXTURE_POLICIES,
    SCALERS,
    adamw,
    assert_same_params,
    batches,
    clone_run_state,
    flat_params,
    forward_loss,
    is_primitive,
    make,
    run,
    tiny_model,
    train_step,
)

NAMES = list(SCALERS)
pytestmark = pytest.mark.parametrize("name", NAMES)


class _TaggedSGD(torch.optim.SGD):
    """An optimizer whose ``step`` returns something, to check that ``scaler.step`` passes it on."""

    def step(self, closure=None, tag=None):
        super().step(closure)
        return ("stepped", tag)


def test_registry_has_the_builtin_rules(name):
    assert {
        "static",
        "torch",
        "deepspeed",
        "megatron",
        "jmp",
        "fairseq",
        "metaseq",
        "amax-history",
    } <= set(NAMES)
    assert isinstance(make(name), torch.amp.GradScaler)


def test_gradscaler_api(name):
    scaler = make(name, init_scale=2.0**8)
    assert scaler.is_enabled() is True
    first = scaler.get_scale()
    assert isinstance(first, float) and 0 < first < math.inf

    model = tiny_model()
    opt = _TaggedSGD(model.parameters(), lr=0.1)
    ((x, y),) = batches(1)
    loss = forward_loss(model, x, y)
    scaled = scaler.scale(loss)
    used = scaled.item() / loss.item()
    if scaler.rule.scale_time:  # it picks this step's scale from the loss, when it is scaled
        assert scaler.min_scale <= used <= scaler.max_scale
    else:
        assert used == pytest.approx(first, rel=1e-6)
    pair = scaler.scale([loss.detach(), 2 * loss.detach()])  # later outputs: the same scale
    assert isinstance(pair, list) and pair[1].item() == pytest.approx(
        2 * loss.item() * used, rel=1e-6
    )

    scaled.backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    before = flat_params(model)
    assert scaler.step(opt, None, tag=7) == (
        "stepped",
        7,
    )  # positional and keyword args pass through
    assert not torch.equal(before, flat_params(model))
    scaler.update()
    assert scaler.steps == 1 and scaler.skipped == 0
    assert scaler.last_stats.scale == pytest.approx(used, rel=1e-6)  # the scale the step used

    # an overflowing step is skipped: step() returns None and the weights do not move
    opt.zero_grad()
    scaler.scale(forward_loss(model, x, y, inf=True)).backward()
    before = flat_params(model)
    assert scaler.step(opt, tag=8) is None
    assert torch.equal(before, flat_params(model))
    scaler.update()
    assert scaler.skipped == 1
    assert scaler.last_stats.found_inf is True


def test_gradient_accumulation_and_loss_record(name):
    scaler = make(name, init_scale=2.0**8)
    first = scaler.get_scale()  # init_scale, or an exported policy's first decision from it
    model = tiny_model()
    opt = adamw(model)
    (x1, y1), (x2, y2) = batches(2)
    opt.zero_grad()
    losses, used = [], []
    for x, y in ((x1, y1), (x2, y2)):  # two micro-batches, one optimizer step
        loss = forward_loss(model, x, y)
        losses.append(loss.item())
        scaled = scaler.scale(loss)
        used.append(scaled.item() / loss.item())
        scaled.backward()
    scaler.step(opt)
    scaler.update()
    stats = scaler.last_stats
    assert stats.found_inf is False and stats.loss_seen is True
    assert stats.loss == pytest.approx(sum(losses) / 2, rel=1e-6)
    # one scale for the step's micro-batches: the rule's, or (scale_time) the one it picked
    # from the first loss
    assert used[1] == pytest.approx(used[0], rel=1e-6)
    assert stats.scale == (pytest.approx(used[0], rel=1e-6) if scaler.rule.scale_time else first)
    assert stats.step == 0


def test_state_dict_is_primitive_and_loads_with_weights_only(name, tmp_path):
    scaler = make(name, init_scale=2.0**8)
    model = tiny_model()
    opt = adamw(model)
    run(model, opt, scaler, batches(7), inf_steps={2, 3})
    state = scaler.state_dict()
    assert is_primitive(state), state
    assert state["scale"] == scaler.get_scale()
    assert state["autoscale"]["rule"] == name and state["autoscale"]["skipped"] == 2

    path = tmp_path / "scaler.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded == state

    fresh = make(name)
    fresh.load_state_dict(loaded)
    assert fresh.get_scale() == scaler.get_scale()
    assert fresh.state_dict() == state


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_fp16_autocast_training(name, fused):
    model = tiny_model()
    opt = adamw(model, fused=fused)
    scaler = make(name, init_scale=2.0**8)
    data = batches(12)
    first_loss = forward_loss(model, *data[0]).item()
    skip_at = {4, 5}
    frozen = {}

    def remember(i):
        frozen[i] = flat_params(model)

    trace = run(model, opt, scaler, data, inf_steps=skip_at, each=remember)
    assert trace.skipped == [4, 5]
    assert torch.equal(frozen[3], frozen[4]) and torch.equal(
        frozen[4], frozen[5]
    )  # skipped: unchanged
    assert not torch.equal(frozen[5], frozen[6])
    assert scaler.steps == 12 and scaler.skipped == 2
    assert all(math.isfinite(s) and s > 0 for s in trace.after)
    assert torch.isfinite(flat_params(model)).all()
    assert forward_loss(model, *data[0]).item() < first_loss


@pytest.mark.parametrize("optim", ["sgd", "adamw", "adamw-fused"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_step_was_skipped_says_what_the_optimizer_did(name, optim, clip):
    """``step_was_skipped`` after ``step()``, after ``update()`` and after ``update(new_scale)``
    equals what happened to the parameters, on plain and fused optimizers."""
    model = tiny_model()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optim == "sgd"
        else adamw(model, fused=optim == "adamw-fused")
    )
    scaler = make(name, init_scale=2.0**8)
    assert scaler.step_was_skipped is False  # before the first step
    inf_steps, seen = {1, 2, 5}, []
    for i, (x, y) in enumerate(batches(7)):
        before = flat_params(model)
        opt.zero_grad(set_to_none=True)
        scaler.scale(forward_loss(model, x, y, inf=i in inf_steps)).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        after_step = scaler.step_was_skipped
        if i == 5:  # a forced scale: the step's own answer still holds
            scaler.update(scaler.get_scale())
        else:
            scaler.update()
        unchanged = torch.equal(before, flat_params(model))
        assert after_step == scaler.step_was_skipped == unchanged, (i, after_step, unchanged)
        seen.append(scaler.step_was_skipped)
    assert [i for i, s in enumerate(seen) if s] == sorted(inf_steps)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_clipping_sees_unscaled_gradients(name, fused):
    model = tiny_model()
    opt = adamw(model, fused=fused)
    scaler = make(name, init_scale=2.0**10)
    ((x, y),) = batches(1)
    scale = scaler.get_scale()
    opt.zero_grad()
    loss = forward_loss(model, x, y)
    out = scaler.scale(loss)
    if scaler.rule.scale_time:  # the scale it picked from this loss
        scale = out.item() / loss.item()
    out.backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    for g, p in zip(scaled, model.parameters()):
        torch.testing.assert_close(p.grad, g / scale, rtol=1e-6, atol=0)
    expected_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g / scale) for g in scaled])
    )
    max_norm = expected_norm.item() / 4
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    clipped = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])
    )
    assert clipped.item() == pytest.approx(max_norm, rel=1e-4)

    # the step applies the clipped gradients once (fused optimizers must not unscale them again)
    reference, ref_opt = clone_run_state(model, opt, fused=fused)
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    before = flat_params(model)
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    assert not torch.equal(before, flat_params(model))
    assert_same_params(model, reference)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_state_dict_round_trip_mid_run_continues_identically(name, fused, tmp_path):
    data = batches(16)
    inf_steps = {1, 2, 6, 11, 12}
    model = tiny_model()
    opt = adamw(model, fused=fused)
    scaler = make(name)
    run(model, opt, scaler, data[:8], inf_steps)

    buf = io.BytesIO()
    torch.save({"scaler": scaler.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, _ = clone_run_state(model, opt, fused=fused)
    opt2 = adamw(model2, fused=fused)
    opt2.load_state_dict(ckpt["optimizer"])
    resumed = make(name)
    resumed.load_state_dict(ckpt["scaler"])

    a = run(model, opt, scaler, data[8:], inf_steps, start=8)
    b = run(model2, opt2, resumed, data[8:], inf_steps, start=8)
    assert a.scales == b.scales and a.after == b.after
    assert a.skipped == b.skipped
    assert_same_params(model, model2)
    assert resumed.state_dict() == scaler.state_dict()


def test_pickle_between_steps(name):
    data = batches(10)
    model = tiny_model()
    opt = adamw(model)
    scaler = make(name)
    run(model, opt, scaler, data[:5], inf_steps={1})
    clone = pickle.loads(pickle.dumps(scaler))
    assert type(clone) is type(scaler)
    assert clone.get_scale() == scaler.get_scale()
    assert clone.state_dict() == scaler.state_dict()

    model2, opt2 = clone_run_state(model, opt)
    a = run(model, opt, scaler, data[5:], inf_steps={7}, start=5)
    b = run(model2, opt2, clone, data[5:], inf_steps={7}, start=5)
    assert a.scales == b.scales and a.after == b.after
    assert_same_params(model, model2)


def test_500_overflows_never_kill_the_scale(name):
    model = tiny_model()
    opt = adamw(model)
    scaler = make(name)
    ((x, y),) = batches(1)
    seen = []
    for _ in range(500):
        train_step(model, opt, scaler, x, y, inf=True)
        seen.append(scaler.get_scale())
    assert all(0 < s < math.inf for s in seen)
    assert min(seen) >= scaler.min_scale
    assert scaler.skipped == 500
    assert scaler.hit_min == (min(seen) == scaler.min_scale)
    assert torch.isfinite(flat_params(model)).all()
    # the scale tensor the next backward multiplies by agrees with the host copy
    assert scaler._scale.item() == scaler.get_scale()


def test_disabled_behaves_like_disabled_gradscaler(name):
    data = batches(4)
    ours_model, ref_model = tiny_model(), tiny_model()
    ours_opt, ref_opt = adamw(ours_model), adamw(ref_model)
    ours = make(name, enabled=False)
    ref = torch.amp.GradScaler("cpu", enabled=False)
    assert ours.is_enabled() is False
    assert ours.get_scale() == ref.get_scale() == 1.0
    loss = forward_loss(ours_model, *data[0])
    assert ours.scale(loss) is loss
    assert ours.state_dict() == ref.state_dict() == {}
    ours.load_state_dict({"scale": 8.0})  # a no-op, as in GradScaler
    assert ours.get_scale() == 1.0
    a = run(ours_model, ours_opt, ours, data)
    b = run(ref_model, ref_opt, ref, data)
    assert a.skipped == b.skipped == []
    assert_same_params(ours_model, ref_model)


def test_raise_at_min(name):
    model = tiny_model()
    opt = adamw(model)
    ((x, y),) = batches(1)
    # max_scale pins policies too, which may choose to keep the scale up after an overflow
    scaler = make(name, init_scale=2.0, min_scale=2.0, max_scale=2.0, raise_at_min=True)
    # it raises exactly on the first overflow that the rule would answer by lowering the scale
    # (not while hysteresis or a tolerance absorbs it; never for a static scale)
    raised = None
    for i in range(10):
        backs_off = scaler.rule.backs_off_on_overflow()
        try:
            train_step(model, opt, scaler, x, y, inf=True)
        except MinimumLossScaleError as exc:
            assert backs_off and "minimum" in str(exc), f"raised at overflow {i}"
            raised = i
            break
        assert not backs_off, f"overflow {i} would lower the scale but did not raise"
    assert (raised is None) == (type(scaler.rule).__name__ == "StaticRule")
    assert scaler.get_scale() == 2.0
    assert 1 <= scaler.skipped <= 10
    # the scaler is left usable: the next clean step runs
    train_step(model, opt, scaler, x, y)
    assert scaler.last_stats.found_inf is False


def test_minimum_is_reported_not_raised_by_default(name):
    model = tiny_model()
    opt = adamw(model)
    ((x, y),) = batches(1)
    scaler = make(name, init_scale=2.0, min_scale=2.0, max_scale=2.0)
    for _ in range(5):
        train_step(model, opt, scaler, x, y, inf=True)
    assert scaler.get_scale() == 2.0
    assert scaler.hit_min and scaler.min_hits == 5


def test_spec_rebuilds_the_scaler(name, monkeypatch):
    monkeypatch.setenv("AUTOSCALE_POLICY_PATH", str(FIXTURE_POLICIES))  # policies by their name
    scaler = make(name)
    spec = scaler.spec()
    assert spec["name"] == name
    rebuilt = autoscale.get_scaler(device="cpu", **spec)
    assert type(rebuilt.rule) is type(scaler.rule)
    assert rebuilt.spec() == spec
