"""FSDP runs on two ranks, shared by tests/integrations/test_fsdp.py (CPU, gloo) and
tests/gpu/test_fsdp_cuda.py (CUDA, nccl): tiny models sharded by FSDP2 (``fully_shard``) or FSDP1
(``FullyShardedDataParallel``), trained by a scaler through a non-finite batch and an
overflow in one element of its shard alone, on the last rank."""

from __future__ import annotations

import gc
import importlib
import json
import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoscale

BAD_BATCH, SHARD_INF, STEPS = 1, 3, 5  # rank 1's non-finite batch; rank 1's shard alone overflows


def scaler_names() -> list[str]:
    """Every scaler ``get_scaler`` builds here: the rules and the exported policies."""
    return [s.name for s in autoscale.list_scalers() if s.usable and s.kind in ("rule", "policy")]


def _net(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return net.to(device)


def fsdp2(device: torch.device, offload: bool = False) -> torch.nn.Module:
    """FSDP2: DTensor parameters and gradients (on the CPU with ``offload``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    net = _net(device)
    fully_shard(net[0], offload_policy=policy)
    return fully_shard(net, offload_policy=policy)


def fsdp1(device: torch.device, fp16: bool = False, offload: bool = False) -> torch.nn.Module:
    """FSDP1: flat local shards; ``fp16``: FSDP's own float16 (float16 loss and gradients);
    ``offload``: parameters and gradients on the CPU."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision

    mixed = MixedPrecision(torch.float16, torch.float16, keep_low_precision_grads=True)
    return FullyShardedDataParallel(
        _net(device),
        device_id=device,
        mixed_precision=mixed if fp16 else None,
        cpu_offload=CPUOffload(offload_params=offload),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(
    rank: int, model: torch.nn.Module, scaler, device: torch.device, fp16: bool = False
) -> dict:
    """STEPS steps; per step: skipped or not, the next scale, and the scaler's amax and RMS with
    those of the whole unscaled gradient (gathered across the ranks); the final local weights."""
    opt = (torch.optim.SGD if fp16 else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    bad_rank = dist.get_world_size() - 1
    keys = ("skipped", "scales", "amax", "rms", "true_amax", "true_rms")
    out: dict = {key: [] for key in keys}
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if step == BAD_BATCH and rank == bad_rank:
            x[0, 0] = math.inf
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        if fp16:  # FSDP's own float16: a float16 loss
            pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y.to(pred.dtype))
        else:
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == SHARD_INF and rank == bad_rank:
            next(_local(p.grad) for p in model.parameters() if _local(p.grad).numel())[0] = math.inf
        before = [_local(p).detach().clone() for p in model.parameters()]
        scaler.unscale_(opt)
        amax, rms = _whole_gradient(model, device)
        scaler.step(opt)
        scaler.update()
        if all(torch.equal(b, _local(p)) for b, p in zip(before, model.parameters())):
            out["skipped"].append(step)
        out["scales"].append(scaler.get_scale())
        stats = getattr(scaler, "last_stats", None)
        out["amax"].append(stats.grad_amax if stats else None)
        out["rms"].append(stats.grad_rms if stats else None)
        out["true_amax"].append(amax)
        out["true_rms"].append(rms)
    out["weights"] = [_local(p).detach().double().reshape(-1).tolist() for p in model.parameters()]
    return out


def _whole_gradient(model: torch.nn.Module, device: torch.device) -> tuple[float, float]:
    """The amax and RMS of the whole unscaled gradient, across the ranks: FSDP2's DTensors
    gathered whole where they live on the process group's device, else each rank's shard
    reduced (FSDP1's flat shards are padded with zeros: the RMS counts them)."""
    grads = [p.grad for p in model.parameters()]
    if hasattr(grads[0], "full_tensor") and grads[0].device.type == device.type:
        full = torch.cat([g.full_tensor().reshape(-1) for g in grads]).double()
        return float(full.abs().max()), float(full.square().mean().sqrt())
    mine = torch.cat([_local(g).reshape(-1) for g in grads]).double()
    amax = mine.abs().max().reshape(1).to(device)
    sums = torch.stack([mine.square().sum(), mine.new_tensor(float(mine.numel()))]).to(device)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums)
    return float(amax), float((sums[0] / sums[1]).sqrt())


def scenarios(rank: int, device: torch.device, names: list[str], offload: bool) -> dict:
    """Every run the tests read, by name (see the tests)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from autoscale.scalers.sharded import sharded_scaler

    dev = device.type
    results: dict = {}
    for name in names:
        opts = {"device": dev, "init_scale": 2.0**10, "collect_stats": True}
        results[f"fsdp2-{name}"] = train(
            rank, fsdp2(device), autoscale.get_scaler(name, **opts), device
        )
        results[f"fsdp1-{name}"] = train(rank, fsdp1(device), sharded_scaler(name, **opts), device)
    auto = sharded_scaler("auto", dev, init_scale=2.0**16)
    results["fsdp1-fp16-auto"] = train(rank, fsdp1(device, fp16=True), auto, device, fp16=True)
    knobs = {"init_scale": 2.0**16, "growth_interval": 2}
    variants = {"": {}, "-fp16": {"fp16": True}}
    if offload:
        variants["-offload"] = {"offload": True}
    for tag, how in variants.items():  # ShardedGradScaler itself, and the torch rule in its place
        fp16 = how.get("fp16", False)
        results[f"sharded{tag}"] = train(
            rank, fsdp1(device, **how), ShardedGradScaler(dev, **knobs), device, fp16
        )
        results[f"torch-as-sharded{tag}"] = train(
            rank, fsdp1(device, **how), sharded_scaler("torch", dev, **knobs), device, fp16
        )
    if offload:  # FSDP2's gradients on the CPU, the scale on the device
        for name in ("torch", "auto"):
            scaler = autoscale.get_scaler(name, dev, init_scale=2.0**10, collect_stats=True)
            results[f"fsdp2-offload-{name}"] = train(
                rank, fsdp2(device, offload=True), scaler, device
            )
    return results


def assert_ranks_agree(runs: list[dict], whole_rms: bool) -> None:
    """Each rank's run skipped the last rank's bad batch and its overflowing shard, and no other
    step, with one scale on every rank; its amax (and with ``whole_rms`` its RMS: FSDP1's shards
    are padded, zeros count in theirs) is the whole gradient's, not its shard's."""
    clean = sorted(set(range(STEPS)) - {BAD_BATCH, SHARD_INF})
    for run in runs:
        assert run["skipped"] == [BAD_BATCH, SHARD_INF]
        assert run["scales"] == runs[0]["scales"]
        for step in clean:
            assert run["amax"][step] == pytest.approx(run["true_amax"][step], rel=1e-6)
            if whole_rms:
                assert run["rms"][step] == pytest.approx(run["true_rms"][step], rel=1e-4)
    assert len({runs[0]["true_amax"][step] for step in clean}) == len(clean)  # a reading per step


def assert_same_training(ours: dict, theirs: dict) -> None:
    """The same skipped steps, scales and final weights, bit for bit."""
    assert ours["skipped"] == theirs["skipped"]
    assert ours["scales"] == theirs["scales"]
    assert ours["weights"] == theirs["weights"]


def _worker(
    rank: int, init_file: str, out_dir: str, world: int, dev: str, names: list[str]
) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if dev == "cuda" else "gloo"
    # FSDP before the group, or the group outlives destroy_process_group (scripts/fsdp_run.py)
    importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device(dev)
    if dev == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    try:
        results = scenarios(rank, device, names, offload=dev == "cuda")
    except Exception:
        results = {"error": traceback.format_exc()}
    # written before the process group goes away, so that a failure is reported with its cause
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # the scenarios' sharded models hold the group through reference cycles: collected before
    # it, or its gloo threads are destroyed at exit, which can abort (scripts/fsdp_run.py)
    gc.collect()
    dist.destroy_process_group()


def run_ranks(tmp: Path, world: int, dev: str, names: list[str]) -> list[dict]:
    """:func:`scenarios` on ``world`` ranks (spawned processes), each rank's results."""
    try:
        mp.spawn(_worker, args=(str(tmp / "init"), str(tmp), world, dev, names), nprocs=world)
    except mp.ProcessExitedException:
        if not all((tmp / f"rank{r}.json").exists() for r in range(world)):
            raise
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results
