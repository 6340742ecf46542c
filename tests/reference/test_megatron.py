"""Our ``megatron`` rule against megatron-core's own ``DynamicGradScaler``.

Megatron's scaler keeps its scale in float32 tensors that it creates with ``device='cuda'``. To
run its own code on a CPU, its module source is executed once more with only those device
arguments changed to ``'cpu'`` (the test checks that nothing else differs); the update logic,
float32 arithmetic and asserts are Megatron's.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings

import pytest
import torch

from tests.reference.helpers import (
    TOP,
    describe_difference,
    events,
    first_difference,
    our_scales,
    sequences,
)

CUDA_ARG = "device='cuda'"


@functools.cache
def _grad_scaler() -> types.ModuleType:
    """megatron-core's grad_scaler module, imported by the first test that runs it (a second of
    import each time the tests are collected otherwise); the test skips where it is missing."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        return pytest.importorskip(
            "megatron.core.optimizer.grad_scaler",
            reason="megatron-core is not installed: pip install -e '.[reference]'",
        )


@functools.cache
def _megatron() -> types.ModuleType:
    """Megatron's grad_scaler module, run once more with its scale tensors on the CPU."""
    grad_scaler = _grad_scaler()
    source = inspect.getsource(grad_scaler)
    patched = source.replace(CUDA_ARG, "device='cpu'")
    assert source.count(CUDA_ARG) == 4  # the scale, min_scale and the two factors
    assert "cuda" not in patched.replace(
        ".cuda(torch.cuda.current_device())", ""
    )  # checkpoints only
    module = types.ModuleType("megatron_grad_scaler_on_cpu")
    exec(compile(patched, inspect.getsourcefile(grad_scaler), "exec"), module.__dict__)
    return module


# DynamicGradScaler's arguments: (initial_scale, min_scale, growth_factor, backoff_factor,
# growth_interval, hysteresis); the first is Megatron's defaults (megatron/training/arguments.py).
CASES = {
    "defaults": (2.0**32, 1.0, 2.0, 0.5, 1000, 2),
    "interval100-hysteresis1": (2.0**16, 1.0, 2.0, 0.5, 100, 1),
    "interval300-hysteresis4-min1/32": (2.0**12, 2.0**-5, 2.0, 0.5, 300, 4),
    "factors4-and-0.25": (2.0**20, 2.0**-10, 4.0, 0.25, 400, 2),
    "factors1.5-and-0.7": (1000.0, 0.1, 1.5, 0.7, 250, 3),
}


def upstream(overflows, init, min_scale, growth, backoff, interval, hysteresis):
    s = _megatron().DynamicGradScaler(init, min_scale, growth, backoff, interval, hysteresis)
    assert s.scale.device.type == "cpu" and s.scale.dtype == torch.float32
    out = []
    for flag in overflows:
        s.update(bool(flag))
        out.append(s.scale.item())
    return out


def ours(overflows, init, min_scale, growth, backoff, interval, hysteresis, max_scale=TOP):
    params = {
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": interval,
        "hysteresis": hysteresis,
    }
    return our_scales(
        "megatron", params, overflows, init_scale=init, min_scale=min_scale, max_scale=max_scale
    )


@pytest.mark.slow
def test_running_megatrons_own_code_on_cpu():
    s = _megatron().DynamicGradScaler(2.0**32, 1.0, 2.0, 0.5, 1000, 2)
    assert type(s).update.__code__.co_filename == inspect.getsourcefile(_grad_scaler())
    with pytest.raises(AssertionError):  # its own argument checks run too
        _megatron().DynamicGradScaler(2.0**32, 1.0, 0.5, 0.5, 1000, 2)


@pytest.mark.slow  # 10,000-step sequences x 10 seeds
@pytest.mark.parametrize("case", list(CASES))
def test_same_scale_sequence_as_dynamic_grad_scaler(case):
    args = CASES[case]
    seen = {"up": 0, "down": 0, "held_on_overflow": 0, "at_min": 0}
    for name, overflows in sequences():
        theirs = upstream(overflows, *args)
        assert max(theirs) < TOP  # our max_scale never engaged: a pure comparison
        mine = ours(overflows, *args)
        assert mine == theirs, f"{case} {name}: " + describe_difference(mine, theirs, overflows)
        for k, v in events(theirs, args[0], overflows).items():
            seen[k] += v
        seen["at_min"] += sum(1 for t in theirs if t <= args[1] * 1.0000001)
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.slow  # about a second or more
def test_megatron_grows_past_our_max_scale():
    """Megatron has no ceiling; ours stops at max_scale (the only difference on a clean run)."""
    clean = [False] * 3000
    args = (2.0**32, 1.0, 2.0, 0.5, 1000, 2)
    theirs = upstream(clean + [True, True], *args)
    mine = ours(clean + [True, True], *args, max_scale=2.0**33)
    assert mine[:3000] == [min(t, 2.0**33) for t in theirs[:3000]]
    first = first_difference(mine, theirs)
    assert first == 1999 and theirs[first] == 2.0**34 and mine[first] == 2.0**33
    # two overflows: the first spends the hysteresis, the second halves, from 2^35 and from the cap
    assert theirs[-2:] == [2.0**35, 2.0**34] and mine[-2:] == [2.0**33, 2.0**32]
