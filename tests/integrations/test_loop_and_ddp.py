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
