"""A small real fp16 loop shared by the tests of recording, the report and the search on records."""

from __future__ import annotations

import math

import torch


def fp16_loop(
    scaler,
    steps: int,
    *,
    bad: set[int] | None = None,
    bad_every: int | None = None,
    weight: float = 1.0,
    lr_decay: bool = False,
    spikes: dict[int, float] | None = None,
) -> list[float]:
    """Train a 1.4k-parameter MLP for ``steps`` fp16 autocast steps on CPU under ``scaler``; an
    infinite input on the steps in ``bad`` (and every ``bad_every``-th step), the loss times
    ``weight`` (and times ``spikes[step]`` on the steps it names: a finite loss spike); with
    ``lr_decay`` a schedule stepped on every step, skipped ones too. Returns the losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if lr_decay else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if step in (bad or ()) or (bad_every and step % bad_every == bad_every - 1):
            x[0, 0] = math.inf
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * weight
        if spikes and step in spikes:
            loss = loss * spikes[step]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses
