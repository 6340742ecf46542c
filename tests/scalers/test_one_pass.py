"""The one-pass unscale of rules that read the gradient amax (``scalers/grad_stats.py``) gives what
the general path gives: GradScaler's gradients and found-inf flag, the exact amax, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import autoscale
from autoscale.scalers.grad_reader import GradReader
from autoscale.scalers.grad_stats import AbsMax, grad_amax, one_pass_grads
from tests.scalers.helpers import (
    FIXTURE_POLICIES,
    adamw,
    assert_same_params,
    batches,
    forward_loss,
    tiny_model,
)

CPU = torch.device("cpu")


def _grads(seed: int, bad: float | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(33, 17, generator=g) * 1e3, torch.randn(7, generator=g) * 1e-3]
    out.append(torch.randn(5, 5, generator=g) - 10.0)  # all negative: |min| is the amax
    if bad is not None:
        out[1][3] = bad
    return out


@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan], ids=str)
def test_abs_max_reads_what_grad_amax_reads(bad):
    grads = _grads(0, bad)
    ours = AbsMax()(grads, CPU)
    ref = torch.stack([g.abs().max() for g in grads]).max()
    assert torch.equal(ours, ref) or (math.isnan(bad or 0.0) and ours.isnan())
    assert torch.equal(grad_amax(grads, CPU), ours) or ours.isnan()
    assert AbsMax()(grads, CPU).item() == ours.item() or ours.isnan()  # a fresh buffer: same


def test_one_pass_grads_only_for_dense_float32_on_one_device():
    w, v, e = (
        torch.zeros(3, 2, requires_grad=True),
        torch.zeros(4, requires_grad=True),
        torch.zeros(0, requires_grad=True),
    )
    opt = torch.optim.AdamW([w, v, e])
    assert one_pass_grads(opt, CPU) is None  # no gradient yet
    w.grad, e.grad = torch.ones(3, 2), torch.ones(0)
    assert [g.shape for g in one_pass_grads(opt, CPU)] == [(3, 2)]  # no empty tensor
    v.grad = torch.ones(4)
    assert len(one_pass_grads(opt, CPU)) == 2
    d = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    d.grad = torch.ones(2, dtype=torch.float64)
    opt.add_param_group({"params": [d]})
    assert one_pass_grads(opt, CPU) is None  # GradScaler's per-dtype path
    opt.param_groups.pop()
    v.grad = torch.ones(4).to_sparse()
    assert one_pass_grads(opt, CPU) is None  # sparse: GradScaler coalesces


@pytest.mark.parametrize("scale", [2.0**10, 3000.7, 0.37], ids=["2^10", "3000.7", "0.37"])
@pytest.mark.parametrize("bad", [None, math.inf, math.nan], ids=str)
def test_unscale_matches_gradscaler_and_the_amax_of_the_unscaled_gradients(scale, bad):
    x, y = batches(1)[0]
    runs = []
    for scaler in (
        torch.amp.GradScaler("cpu", init_scale=scale),
        autoscale.get_scaler("amax-history", device="cpu", init_scale=scale, min_scale=0.01),
    ):
        model = tiny_model()
        opt = adamw(model)
        scaler.scale(forward_loss(model, x, y)).backward()
        if bad is not None:
            model[2].weight.grad[1, 2] = bad
        scaler.unscale_(opt)
        runs.append((model, opt, scaler))
    (m_ref, o_ref, ref), (m_ours, o_ours, ours) = runs
    # the one pass, its amax read on the host of a CPU scaler
    assert isinstance(ours._per_optimizer_states[id(o_ours)]["autoscale_stats"], float)
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        assert torch.equal(a.grad, b.grad) or (bad is not None and a.grad.isnan().any())
    flag = list(ours._found_inf_per_device(o_ours).values())
    assert [f.item() for f in flag] == [f.item() for f in ref._found_inf_per_device(o_ref).values()]
    ours.step(o_ours)
    ours.update()
    amax = torch.stack([p.grad.abs().max() for p in m_ours.parameters()]).max().item()
    assert ours.last_stats.grad_amax == amax or (math.isnan(amax) and bad is not None)
    assert ours.last_stats.found_inf == (bad is not None)


def test_a_flag_reduced_by_the_caller_after_unscale_is_the_one_obeyed():
    # the pattern of loops that all_reduce scaler._found_inf_per_device(opt) in place
    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler("auto", device="cpu")
    scaler.scale(forward_loss(model, *batches(1)[0])).backward()
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in model.parameters()]
    for flag in scaler._found_inf_per_device(opt).values():
        flag.fill_(1.0)
    scaler.step(opt)
    scaler.update()
    assert scaler.step_was_skipped and scaler.last_stats.found_inf
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
@pytest.mark.parametrize("rule", ["amax-history", "auto", "fixture-neural", "amax-rms"])
def test_one_pass_and_general_path_train_alike(rule, fused):
    # the general path: GradScaler's unscale, then a read of the statistics (kept for gradients
    # the one pass cannot take); a neural policy reads the RMS too, and so does a rule told to
    # collect every statistic
    name = str(FIXTURE_POLICIES / rule) if rule.startswith("fixture") else rule
    data = batches(40)
    bad, spikes = {3, 11, 12, 29}, {6, 17, 18, 33}
    runs = []
    for general in (False, True):
        model = tiny_model()
        opt = adamw(model, fused=fused)
        if rule == "amax-rms":
            scaler = autoscale.get_scaler("amax-history", device="cpu", collect_stats=True)
        else:
            scaler = autoscale.get_scaler(name, device="cpu")
        assert scaler.grads.rms == (rule not in ("amax-history", "auto"))
        if general:
            scaler._one_pass_grads = lambda optimizer: None  # the general path
        seen = []
        for i, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            loss = forward_loss(model, x, y) * (1e3 if i in spikes else 1.0)
            scaler.scale(loss).backward()
            if i in bad:
                model[0].weight.grad[0, 0] = math.inf
            if i % 4 == 1:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            s = scaler.last_stats
            seen.append(
                (
                    s.scale,
                    s.found_inf,
                    s.grad_amax,
                    s.grad_rms,
                    s.loss,
                    s.guarded,
                    scaler.get_scale(),
                )
            )
        if not general:  # every step went through the one pass
            assert one_pass_grads(opt, CPU) is not None
        runs.append((model, seen))
    (m_one, one), (m_gen, gen) = runs
    assert repr(one) == repr(gen)  # repr: NaN amaxes compare too, and the sign of zeros
    assert sum(s[1] for s in one) >= len(bad)
    assert_same_params(m_one, m_gen)


@pytest.mark.parametrize("grad_on", [True, False], ids=["grad-on", "grad-off"])
def test_the_one_pass_leaves_autograd_as_it_found_it(grad_on):
    # the one pass turns autograd off without torch.no_grad()'s context: it must turn it back on,
    # and only where it was on
    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler("auto", device="cpu")
    scaler.scale(forward_loss(model, *batches(1)[0])).backward()
    with torch.set_grad_enabled(grad_on):
        scaler.unscale_(opt)
        assert torch.is_grad_enabled() is grad_on
    assert isinstance(scaler._per_optimizer_states[id(opt)]["autoscale_stats"], float)


def test_the_one_pass_turns_autograd_back_on_when_it_raises(monkeypatch):
    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler("auto", device="cpu")
    scaler.scale(forward_loss(model, *batches(1)[0])).backward()

    def broken(*args, **kwargs):
        assert not torch.is_grad_enabled()  # the pass reads with autograd off
        raise RuntimeError("read failed")

    monkeypatch.setattr(torch, "aminmax", broken)  # the pass's first op on a CPU
    try:
        with pytest.raises(RuntimeError, match="read failed"):
            scaler.unscale_(opt)
        assert torch.is_grad_enabled()
    finally:  # a failure here must not leave the tests after it without autograd
        torch.set_grad_enabled(True)


@pytest.mark.parametrize("path", ["host", "rms", "fused", "plain"])
def test_the_one_pass_unscales_gradients_that_carry_a_graph(path):
    # backward(create_graph=True): the gradients require grad; the pass must read and unscale
    # them with autograd off, as GradScaler's unscale runs under no_grad (with it on, an
    # aminmax(out=...) of them raises and an in-place unscale records into their graph).
    # host: auto on a CPU; rms: the statistics read on the device path (collect_stats); fused:
    # a fused optimizer, whose found-inf flag comes from the amax read without unscaling;
    # plain: the torch rule, GradScaler's kernel without a read (GradReader.unscale_plain;
    # torch 2.13's kernel records nothing with autograd on either: the switch there mirrors
    # GradScaler's no_grad, and this case checks the result)
    fused = path == "fused"
    rule = "torch" if path == "plain" else "auto"
    runs = []
    for scaler in (
        torch.amp.GradScaler("cpu"),
        autoscale.get_scaler(
            rule, device="cpu", **({"collect_stats": True} if path == "rms" else {})
        ),
    ):
        model = tiny_model()
        opt = adamw(model, fused=fused)
        scaler.scale(forward_loss(model, *batches(1)[0])).backward(create_graph=True)
        fns = [p.grad.grad_fn for p in model.parameters()]
        if not fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert [p.grad.grad_fn for p in model.parameters()] == fns
        assert torch.is_grad_enabled()
        runs.append(model)
    assert_same_params(*runs)


@pytest.fixture
def sorted_by_gradscaler(monkeypatch) -> list[str]:
    """The class of each scaler that GradScaler's ``_unscale_grads_`` runs for, in order."""
    calls: list[str] = []
    real = torch.amp.GradScaler._unscale_grads_

    def counted(self, *args):
        calls.append(type(self).__name__)
        return real(self, *args)

    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", counted)
    return calls


@pytest.mark.parametrize("grad_on", [True, False], ids=["grad-on", "grad-off"])
def test_a_rule_without_statistics_unscales_with_gradscalers_kernel_alone(monkeypatch, grad_on):
    # dense float32 gradients skip GradScaler's _unscale_grads_ (its Python sorting of every
    # gradient by device and dtype: most of its unscale_ on a CPU) for the kernel it calls;
    # the same gradients and flag, autograd left as it was found
    plain = []
    real = GradReader.unscale_plain

    def counted(self, *args):
        plain.append(len(args[0]))
        return real(self, *args)

    monkeypatch.setattr(GradReader, "unscale_plain", counted)
    runs = []
    for scaler in (torch.amp.GradScaler("cpu"), autoscale.get_scaler("torch", device="cpu")):
        model = tiny_model()
        opt = adamw(model)
        scaler.scale(forward_loss(model, *batches(1)[0])).backward()
        model[2].weight.grad[0, 1] = math.inf
        with torch.set_grad_enabled(grad_on):
            scaler.unscale_(opt)
            assert torch.is_grad_enabled() is grad_on
        runs.append((model, [f.item() for f in scaler._found_inf_per_device(opt).values()]))
    assert plain == [4]  # once, with the model's four gradients
    (m_ref, flags_ref), (m_ours, flags_ours) = runs
    assert flags_ours == flags_ref == [1.0]
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())


def test_gradients_the_kernel_alone_cannot_take_go_through_gradscalers_sorting(
    sorted_by_gradscaler,
):
    # float16 gradients: GradScaler's error; a float64 one beside float32 ones: its per-dtype
    # lists, the same gradients
    model = tiny_model().half()
    scaler = autoscale.get_scaler("torch", device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, model[0].in_features, dtype=torch.half)).sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    runs = []
    for scaler in (torch.amp.GradScaler("cpu"), autoscale.get_scaler("torch", device="cpu")):
        model = tiny_model()
        model[2].double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(2, model[0].in_features)
        out = model[2](model[1](model[0](x)).double())
        scaler.scale(out.sum()).backward()
        scaler.unscale_(opt)
        runs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert sorted_by_gradscaler == ["LossScaler", "GradScaler", "LossScaler"]


def test_a_gradscaler_sort_another_library_replaced_is_kept(sorted_by_gradscaler):
    # extensions for other devices have replaced GradScaler._unscale_grads_ in place: the
    # kernel path goes around GradScaler's own sort only, never around a replacement
    model = tiny_model()
    opt = adamw(model)
    scaler = autoscale.get_scaler("torch", device="cpu")
    scaler.scale(forward_loss(model, *batches(1)[0])).backward()
    scaler.unscale_(opt)
    assert sorted_by_gradscaler == ["LossScaler"]
