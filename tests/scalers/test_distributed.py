"""Distributed agreement (DESIGN.md 3.5): every rank takes the same decision.

Two CPU processes on gloo, deliberately *without* DDP so that gradients differ per rank: only rank
1's loss is made infinite, yet both ranks must skip the step and keep equal scales; the gradient
amax a rule reads is the maximum over the ranks.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoscale
from tests.scalers.helpers import adamw, batches, flat_params, forward_loss, tiny_model

pytestmark = pytest.mark.slow  # spawns process groups (seconds each)
WORLD = 2
INF_STEP = 1  # only rank 1 overflows, at this step
STEPS = 3


def _scenario(rank: int, name: str, fused: bool, unscale: bool = True) -> dict:
    model = tiny_model()  # same weights on both ranks
    opt = adamw(model, fused=fused)
    scaler = autoscale.get_scaler(name, device="cpu", init_scale=2.0**8)
    data = batches(STEPS, seed=10 + rank)  # different data per rank
    out = {"skipped": [], "scales": [], "local_amax": [], "amax": []}
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = forward_loss(model, x, y, inf=rank == 1 and i == INF_STEP) * (1 + 9 * rank)
        scaler.scale(loss).backward()
        if unscale:  # else a fused optimizer unscales inside its kernel
            scaler.unscale_(opt)
        out["local_amax"].append(max(p.grad.abs().max().item() for p in model.parameters()))
        before = flat_params(model)
        scaler.step(opt)
        scaler.update()
        if torch.equal(before, flat_params(model)):
            out["skipped"].append(i)
        out["scales"].append(scaler.get_scale())
        out["amax"].append(scaler.last_stats.grad_amax)
    out["found_inf"] = scaler.skipped
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {
            f"{name}-{'fused' if fused else 'adamw'}": _scenario(rank, name, fused)
            for name in ("torch", "amax-history")
            for fused in (False, True)
        }
        # a fused step without unscale_ checks for infs inside GradScaler.step instead
        results["torch-fused-in-step"] = _scenario(rank, "torch", fused=True, unscale=False)
    except Exception:
        results = {"error": traceback.format_exc()}
    # written before the process group goes away, so that a failure is reported with its cause
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    try:
        mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    except mp.ProcessExitedException:
        if not all((tmp / f"rank{r}.json").exists() for r in range(WORLD)):
            raise
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


CASES = pytest.mark.parametrize(
    "case",
    [
        "torch-adamw",
        "torch-fused",
        "torch-fused-in-step",
        "amax-history-adamw",
        "amax-history-fused",
    ],
)


@CASES
def test_all_ranks_skip_when_one_rank_overflows(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r1["skipped"] == [INF_STEP]
    assert r0["skipped"] == [INF_STEP], "rank 0 stepped although rank 1 overflowed"
    assert r0["found_inf"] == r1["found_inf"] == 1


@CASES
def test_scales_stay_equal(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["scales"] == r1["scales"]
    assert r0["scales"][INF_STEP] < r0["scales"][0]  # both backed off


@pytest.mark.parametrize("case", ["amax-history-adamw", "amax-history-fused"])
def test_amax_is_the_max_over_ranks(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    for step in range(STEPS):
        if step == INF_STEP:
            # rank 1's NaN amax wins the reduction on both ranks (a MAX alone would drop NaN)
            assert math.isnan(r1["local_amax"][step]) or math.isinf(r1["local_amax"][step])
            assert r0["amax"][step] == r1["amax"][step] == math.inf
            continue
        expected = max(r0["local_amax"][step], r1["local_amax"][step])
        assert r0["local_amax"][step] != r1["local_amax"][step]
        assert r0["amax"][step] == r1["amax"][step] == pytest.approx(expected, rel=1e-6)
