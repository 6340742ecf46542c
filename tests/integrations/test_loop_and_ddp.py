"""Plain loop and DDP: the scaler is a GradScaler, used exactly as torch documents it.

DDP runs in-process as a one-rank gloo group, so that the scaler's cross-rank reduction path is
taken; agreement between several ranks is tested in tests/scalers/test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import autoscale
from tests.integrations.helpers import (
    FAST_TORCH,
    assert_three_clean_fp16_steps,
    record_output_dtypes,
    regression_batches,
    tiny_mlp,
)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_training_loop(ddp, clip_spy, request):
    net = tiny_mlp()
    dtypes = record_output_dtypes(net[0])
    if ddp:
        request.getfixturevalue("one_rank_group")
    model = DDP(net) if ddp else net

    # the README snippet, with the checks around it
    scaler = autoscale.get_scaler("torch", device="cpu", **FAST_TORCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = []
    for x, y in regression_batches(3):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        stats.append(scaler.last_stats)

    assert_three_clean_fp16_steps(scaler, dtypes, clip_spy.norms, stats, net)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_scheduler_waits_for_applied_steps(fused):
    """The README pattern: ``if not scaler.step_was_skipped: scheduler.step()``. Steps 2 and 4
    have an infinite loss: the learning rate of step k is the schedule's value after the number
    of steps applied before it, not after k."""
    torch.manual_seed(0)
    model = tiny_mlp()
    scaler = autoscale.get_scaler("torch", device="cpu", init_scale=2.0**12)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    bad = {2, 4}
    lrs, skipped = [], []
    for step, (x, y) in enumerate(regression_batches(7)):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step in bad:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if not scaler.step_was_skipped:  # the README line
            scheduler.step()
        skipped.append(scaler.step_was_skipped)

    assert [i for i, s in enumerate(skipped) if s] == sorted(bad)
    applied_before = [sum(1 for j in range(i) if j not in bad) for i in range(7)]
    assert lrs == [1e-3 * 0.5**n for n in applied_before]
    assert scheduler.last_epoch == 5 and scaler.skipped == 2
