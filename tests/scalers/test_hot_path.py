"""The CPU shortcuts of the hot path give what the general path gives, bit for bit: the step's
values read one by one instead of packed into a vector, the guard's scale set from the host, one
multiply over small gradients instead of one per gradient, the 1/scale tensors and the guard's
limit kept between steps."""

from __future__ import annotations

import math

import pytest
import torch

from autoscale.scalers import grad_stats
from autoscale.scalers.controller import StepStats
from autoscale.scalers.grad_stats import AbsMax
from autoscale.scalers.rules.guard import LossGuard
from autoscale.scalers.unscale import InverseScale

from .helpers import adamw, batches, flat_params, forward_loss, make, tiny_model

CPU = torch.device("cpu")
# a counter rule, the amax rules (statistics, the guard), auto, a policy deciding at scale time
NAMES = ["torch", "amax-history", "amax-loss", "auto", "fixture-neural-now"]


def _run(name: str, packed: bool) -> tuple[list[str], torch.Tensor]:
    """Ten steps of two micro-batches (three overflowing, one loss spike), fused and plain
    AdamW alternating; the packed path forced where ``packed``. Returns each step's stats (as
    text: NaN compares) and the parameters."""
    scaler = make(name, init_scale=2.0**12)
    model = tiny_model()
    opts = [adamw(model), adamw(model, fused=True)]
    seen = []
    for i, (x, y) in enumerate(batches(10)):
        opt = opts[i % 2]
        opt.zero_grad(set_to_none=True)
        for part in (slice(0, 4), slice(4, 8)):
            loss = forward_loss(model, x[part], y[part], inf=i in (2, 3, 7))
            scaler.scale(loss * (300.0 if i == 5 else 1.0)).backward()
            if packed:
                scaler._cpu = False  # as a scaler on a GPU packs its step
        if i % 3 == 0:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        seen.append(repr(scaler.last_stats.to_dict()))
    return seen, flat_params(model)


@pytest.mark.parametrize("name", NAMES)
def test_the_cpu_read_is_the_packed_read(name):
    read, params = _run(name, packed=False)
    packed, params_packed = _run(name, packed=True)
    assert read == packed
    assert torch.equal(params, params_packed)
    assert any("'found_inf': True" in s for s in read)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_cpu_read_of_a_loss_is_the_packed_ones(dtype):
    """The loss is read as the packed vector holds it: in float32 (a float64 loss rounded)."""
    seen = []
    for packed in (False, True):
        scaler = make("auto", init_scale=2.0**12)
        model = tiny_model()
        opt = adamw(model)
        x, y = batches(1)[0]
        loss = forward_loss(model, x, y)
        scaler.scale(loss.to(dtype) + torch.tensor(1.0 / 3.0, dtype=dtype)).backward()
        if packed:
            scaler._cpu = False
        scaler.step(opt)
        scaler.update()
        seen.append(scaler.last_stats.loss)
    f32 = (loss.to(dtype) + torch.tensor(1.0 / 3.0, dtype=dtype)).float().item()
    assert seen == [f32, f32]


@pytest.mark.parametrize(
    "sizes",
    [[6, 40, 3], [6, 10_000, 9_000], [6, 40_000, 3]],
    ids=["in-cache", "more-than-cache-each-in", "one-large"],
)
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
def test_the_amax_read_multiplies_as_gradscaler_either_way(sizes, bad, monkeypatch):
    """Small gradients are multiplied in one op after their reads, a large one right after its
    own: the same gradients as GradScaler's unscale, the same amax, either way; and so with the
    amax read on the host and GradScaler's own unscale kernel (a CPU scaler's form)."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * 1e3 for n in sizes]
    if bad is not None:
        grads[1][7] = bad
    inv = torch.full((), 2.0**-10)
    theirs = [t.clone() for t in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch.zeros(()), inv)
    want = torch.stack([t.abs().max() for t in grads]).max().item()  # NaN wins, then inf
    outs = []
    for cached in (grad_stats.CACHED_ELEMENTS, 0):  # the shortcut where it applies; never
        monkeypatch.setattr(grad_stats, "CACHED_ELEMENTS", cached)
        ours = [t.clone() for t in grads]
        amax, _ = AbsMax().read(ours, CPU, then_mul=inv)
        assert all(
            torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(ours, theirs)
        )
        outs.append(repr(amax.item()))
        # a CPU scaler's form: GradScaler's own unscale kernel, the amax read on the host
        ours, found = [t.clone() for t in grads], torch.zeros(())
        on_host = AbsMax().unscale_on_host(ours, inv, found)
        assert all(
            torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(ours, theirs)
        )
        assert found.item() == (bad is not None)
        outs.append(repr(on_host))
    assert outs == [repr(want)] * 4


def test_inverse_scales_are_kept_for_a_few_scales():
    inverse = InverseScale()
    scale = torch.full((), 1.0)
    for host in [2.0**k for k in (3, 5, 3, 12, 5)] + [2.0**k for k in range(40)]:
        inv = inverse(scale, host, False, None)
        assert inv.item() == 1.0 / host
    assert len(inverse._cache) <= InverseScale._KEEP
    assert inverse(scale, 8.0, False, None) is inverse(scale, 8.0, False, None)


@pytest.mark.parametrize("floor", [0.0, 4.0, 12.0])
def test_the_guards_kept_limit_is_the_computed_one(floor):
    """The limit is kept between steps and follows each lesson without reading the memory;
    it is computed from the whole memory only where the largest counted ratio leaves it, a loss
    moves the floor's cut, or a state loads: the same limit, bit for bit, on every step."""
    guard = LossGuard(guard_history=4, guard_margin=1.0, guard_floor=floor)
    whole = []  # the steps on which the kept limit was computed from the whole memory
    computed = guard._computed
    guard._computed = lambda: whole.append(1) or computed()
    g = torch.Generator().manual_seed(3)
    for i in range(400):
        loss, amax = torch.rand(2, generator=g).tolist()
        over = i % 7 == 3
        # spiky (the floor's cut moves with the spikes), or falling step by step (auto's floor:
        # the cut moves on most steps, under every remembered loss)
        loss = loss * 2.0 ** (i % 9) if floor < 12 else (1 + loss) * 0.99**i
        stats = StepStats(i, 2.0**10, over, amax * 10, math.nan, loss, True, over)
        guard.observe(2.0**10, stats)
        assert guard.guard_limit() == LossGuard._computed(guard)[0]  # bit for bit
        assert guard.guard_limit() == guard.guard_limit()  # read twice: the same
    # most lessons update the kept limit without reading the memory: the largest ratio left
    assert 0 < len(whole) < 400 * (0.75 if floor else 0.5), len(whole)
    other = LossGuard(guard_history=4, guard_margin=1.0, guard_floor=floor)
    assert other.guard_limit() is None
    other.load_state(guard.state(), "test")
    assert other.guard_limit() == guard.guard_limit() is not None
