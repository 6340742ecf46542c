"""LossScaler computes GradScaler's product and 1/scale itself (fewer ops a step); it still follows
GradScaler's contract where code other than its own writes the private ``_scale``, and where a
subclass puts another GradScaler's ``scale``/``unscale_`` after it in the class order."""

from __future__ import annotations

import pytest
import torch

import autoscale
from autoscale.scalers.scaler import LossScaler

GS = torch.amp.GradScaler

# each writes the scale 8 as some code does, bypassing set_scale (GradScaler's private state)
WRITERS = {
    "fill": lambda s: s._scale.fill_(8.0),
    "replace": lambda s: setattr(s, "_scale", torch.tensor(8.0)),
    "copy": lambda s: s._scale.copy_(torch.tensor(8.0)),
    "GradScaler.load_state_dict": lambda s: GS.load_state_dict(
        s, {**GS("cpu").state_dict(), "scale": 8.0}
    ),
    "GradScaler.update(8.0)": lambda s: GS.update(s, 8.0),
}


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(scaler) -> None:
    model, opt = _model()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def _unscaled(scaler) -> tuple[torch.Tensor, float]:
    """The gradient after scale, backward and unscale_, and get_scale() between them."""
    model, opt = _model()
    scaler.scale(model(torch.ones(2, 4)).pow(2).mean()).backward()
    used = scaler.get_scale()
    scaler.unscale_(opt)
    return model.weight.grad.clone(), used


@pytest.mark.parametrize("name", ["torch", "auto"])
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_scale_written_by_other_code_is_the_one_unscaled_by(name, stats, writer):
    torch_scaler = GS("cpu", init_scale=1024.0)
    ours, twin = (
        autoscale.get_scaler(name, "cpu", init_scale=1024.0, collect_stats=stats) for _ in range(2)
    )
    for scaler in (torch_scaler, ours, twin):
        _step(scaler)
    for scaler in (torch_scaler, ours):
        WRITERS[writer](scaler)
    twin.set_scale(8.0)
    want, want_scale = _unscaled(torch_scaler)
    got, got_scale = _unscaled(ours)
    assert want_scale == 8.0
    assert got_scale == want_scale and ours.get_base_scale() == 8.0
    assert torch.equal(got, want)  # divided by what the loss was multiplied by
    # the rule goes on from it as from set_scale(8)
    _unscaled(twin)
    for scaler in (ours, twin):
        scaler.update()
        _step(scaler)
    assert ours.get_scale() == twin.get_scale()


@pytest.mark.parametrize("writer", ["fill", "replace", "copy"])
def test_a_scale_written_within_a_guarded_step_is_the_scale_set_after_it(writer):
    # auto's guard writes the tensor at scale(); code that writes it after that (before update)
    # sets the scale as outside a guarded step: the tensor, get_scale() and 1/scale agree after
    scaler = autoscale.get_scaler("auto", "cpu", init_scale=1024.0)
    for _ in range(3):  # clean steps with a loss: the guard has a limit now
        _step(scaler)
    model, opt = _model()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    (ref,) = torch.autograd.grad(loss, [model.weight], retain_graph=True)
    scaler.scale(loss).backward()
    assert scaler._guarded
    WRITERS[writer](scaler)
    scaler.unscale_(opt)  # this step's gradients: by the factor the loss took (docs/integrations)
    assert torch.equal(model.weight.grad, ref)
    scaler.step(opt)
    scaler.update()
    # the rule went on from 8 (its next scale is its own); the tensor holds what it set
    assert scaler.get_base_scale() == float(scaler._scale)
    model, opt = _model()
    loss = model(torch.ones(2, 4)).pow(2).mean()
    (ref,) = torch.autograd.grad(loss, [model.weight], retain_graph=True)
    scaled = scaler.scale(loss)
    assert scaled.item() / loss.item() == scaler.get_scale()
    scaled.backward()
    scaler.unscale_(opt)
    assert torch.equal(model.weight.grad, ref)  # divided by what the loss was multiplied by


def test_a_scale_loaded_by_gradscaler_before_the_first_step_is_taken():
    torch_scaler, ours = GS("cpu", init_scale=1024.0), autoscale.get_scaler("torch", "cpu")
    for scaler in (torch_scaler, ours):
        WRITERS["GradScaler.load_state_dict"](scaler)
    assert torch.equal(_unscaled(ours)[0], _unscaled(torch_scaler)[0])
    assert ours.get_scale() == 8.0


def test_the_scalers_own_writes_are_not_taken_for_another_codes():
    """The guard writes auto's scale tensor every step (lowered on a spike): none of it is
    taken for a write by other code (which would read the tensor: a sync on a GPU)."""
    scaler = autoscale.get_scaler("auto", "cpu")
    written, adopt = [], scaler._adopt_written

    def spy():  # what each check for a write finds (inline in _adopt_written)
        written.append(scaler._scale is not None and scaler._written())
        adopt()

    scaler._adopt_written = spy
    model, opt = _model()
    for i in range(30):
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean() * (3000.0 if i == 20 else 1.0)
        scaler.scale(loss).backward()
        used = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == 20:
            assert used < scaler.get_base_scale()  # guarded below the set scale, for one step
    assert len(written) >= 30 and not any(written)


class _KeepDtype(GS):
    """Another GradScaler subclass with its own scale and unscale_ (as ShardedGradScaler has)."""

    calls: list[str]

    def scale(self, outputs):
        self.calls.append("scale")
        return super().scale(outputs).to(outputs.dtype)

    def unscale_(self, optimizer):
        self.calls.append("unscale_")
        super().unscale_(optimizer)


class _Mixed(LossScaler, _KeepDtype):
    pass


def test_a_subclass_keeps_the_scale_and_unscale_of_the_gradscaler_it_mixes_in():
    assert LossScaler._plain_gradscaler and not _Mixed._plain_gradscaler
    scaler = _Mixed(autoscale.get_scaler("torch").rule, device="cpu")
    scaler.calls = []
    model, opt = _model()
    scaled = scaler.scale(model(torch.ones(2, 4)).sum().half())
    assert scaled.dtype is torch.float16
    scaled.float().backward()
    scaler.unscale_(opt)
    assert scaler.calls == ["scale", "unscale_"]


class _OwnSort(GS):
    """A GradScaler subclass that sorts the gradients itself (its own _unscale_grads_)."""

    calls: list[str]

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        self.calls.append("_unscale_grads_")
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


class _MixedSort(LossScaler, _OwnSort):
    pass


def test_a_subclass_keeps_the_gradient_sort_of_the_gradscaler_it_mixes_in():
    # the torch rule's unscale skips GradScaler's _unscale_grads_ for its kernel: not where a
    # GradScaler mixed in after LossScaler has its own
    assert not _MixedSort._plain_gradscaler
    scaler = _MixedSort(autoscale.get_scaler("torch").rule, device="cpu")
    scaler.calls = []
    model, opt = _model()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)
    assert scaler.calls == ["_unscale_grads_"]
