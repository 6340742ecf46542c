"""A tiny fp16 training loop shared by the scaler tests.

Every test drives scalers through the real GradScaler call sequence (``scale`` -> ``backward`` ->
``unscale_`` -> ``step`` -> ``update``) under ``torch.autocast("cpu", dtype=torch.float16)``. A
step is made to overflow by multiplying its loss by inf, so overflows land exactly where a test
wants them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import autoscale

# Overrides that make each rule's counters move within a few steps. A rule missing here is run with
# its defaults, so registering a new rule is enough for the conformance suite to cover it.
FAST = {
    "torch": {"growth_interval": 3},
    "deepspeed": {"loss_scale_window": 3},
    "megatron": {"growth_interval": 3},
    "jmp": {"period": 3},
    "fairseq": {"scale_window": 3},
    "metaseq": {"scale_window": 2},
    "amax-history": {"history_len": 4},
}


FIXTURE_POLICIES = Path(__file__).resolve().parent / "fixtures" / "policies"


def conformance_scalers() -> dict[str, str]:
    """What the conformance suite holds to the drop-in contract, id -> what ``get_scaler`` takes:
    every registered rule, every policy shipped with autoscale, and the fixture policies (one
    parametric, one neural). Found by path, so collection does not depend on the working
    directory or ``AUTOSCALE_POLICY_PATH``."""
    from autoscale.resources import shipped_dir
    from autoscale.scalers.registry import rule_names

    out = {name: name for name in rule_names()}
    for folder in (shipped_dir("policies"), FIXTURE_POLICIES):
        if folder is not None:
            out.update(
                {p.name: str(p) for p in sorted(folder.iterdir()) if (p / "policy.yaml").is_file()}
            )
    return out


SCALERS = conformance_scalers()


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A 2-layer MLP of 1,612 parameters, fp32 weights (autocast runs its matmuls in fp16)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def batches(n: int, seed: int = 1, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)
    ]


def adamw(model: torch.nn.Module, fused: bool = False) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def forward_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, inf: bool = False
) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    return loss * float("inf") if inf else loss


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    inf: bool = False,
    clip: float | None = None,
):
    """One full GradScaler iteration; returns what ``scaler.step`` returned."""
    opt.zero_grad(set_to_none=True)
    scaler.scale(forward_loss(model, x, y, inf)).backward()
    if clip is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    out = scaler.step(opt)
    scaler.update()
    return out


def optimizer_steps(opt: torch.optim.Optimizer) -> int:
    """How many updates the optimizer applied (Adam's per-parameter step count)."""
    p = opt.param_groups[0]["params"][0]
    state = opt.state.get(p, {})
    return int(state["step"]) if "step" in state else 0


@dataclass
class Trace:
    """What a run looked like: the scale each step used, and which steps were skipped."""

    scales: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    after: list[float] = field(default_factory=list)


def run(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    data: Iterable[tuple[torch.Tensor, torch.Tensor]],
    inf_steps: Iterable[int] = (),
    *,
    start: int = 0,
    clip: float | None = None,
    trace: Trace | None = None,
    each: Callable[[int], None] | None = None,
) -> Trace:
    """Train on ``data``; step ``start + i`` overflows when it is in ``inf_steps``."""
    trace = trace if trace is not None else Trace()
    inf_steps = set(inf_steps)
    for i, (x, y) in enumerate(data, start=start):
        before = optimizer_steps(opt)
        trace.scales.append(scaler.get_scale())
        train_step(model, opt, scaler, x, y, inf=i in inf_steps, clip=clip)
        if optimizer_steps(opt) == before:
            trace.skipped.append(i)
        trace.after.append(scaler.get_scale())
        if each is not None:
            each(i)
    return trace


def clone_run_state(model: torch.nn.Module, opt: torch.optim.Optimizer, fused: bool = False):
    """An independent copy of a model and its optimizer (same weights, same moments)."""
    model2 = copy.deepcopy(model)
    opt2 = adamw(model2, fused=fused)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    return model2, opt2


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Bit-identical parameters."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs"


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def is_primitive(obj) -> bool:
    """Only what ``torch.load(weights_only=True)`` and JSON can hold: no tensors, no objects."""
    if isinstance(obj, dict):
        return all(isinstance(k, str) and is_primitive(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(is_primitive(v) for v in obj)
    return obj is None or isinstance(obj, (bool, int, float, str))


def make(name: str, **kw) -> autoscale.LossScaler:
    """``get_scaler`` of a conformance id on CPU, with the rule's fast counters."""
    return autoscale.get_scaler(
        SCALERS.get(name, name), device="cpu", **{**FAST.get(name, {}), **kw}
    )
