"""An FSDP script autoscale never saw, for torchrun on CPU (gloo) or CUDA (nccl, a GPU per rank):
fp16 autocast, a non-finite batch at step 4 on the last rank only and an overflow in one
element of its shard alone at step 6, each rank's own data.

Usage: ``fsdp_run.py KIND SCALER [STEPS] [DEVICE]``: KIND ``fsdp2`` (``fully_shard``, DTensor gradients),
``fsdp1`` (``FullyShardedDataParallel`` on CPU) or ``fsdp1-fp16`` (FSDP1's own float16 mixed
precision: float16 loss and gradients); SCALER ``plain`` (what a user builds:
``torch.amp.GradScaler`` for fsdp2, ``ShardedGradScaler`` for fsdp1), or an autoscale name built
with ``autoscale.get_scaler``; DEVICE ``cpu`` (default) or ``cuda``. Prints ``RANK{r} LOSS {step} {loss}`` each step, then
``RANK{r} END {scaler class} {scale} {skipped steps} {hash of this rank's weights}``, and after
the group is destroyed ``RANK{r} GLOO {threads of a gloo group still running}``.
"""

import gc
import hashlib
import importlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

SHARD_INF = 6  # the step where one gradient element of rank 1's shard is made infinite


def build(kind: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ).to(device)  # fmt: skip
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        # fsdp1-fp16: FSDP's own float16 (parameters, reduction, and gradients kept in float16)
        fp16 = MixedPrecision(torch.float16, torch.float16, keep_low_precision_grads=True)
        mp = fp16 if kind == "fsdp1-fp16" else None
        model = FullyShardedDataParallel(net, device_id=device, mixed_precision=mp)
    if kind == "fsdp1-fp16":  # AdamW refuses float16 gradients of float32 parameters
        return model, torch.optim.SGD(model.parameters(), lr=1e-2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def scaler_for(kind: str, name: str, device: str):
    if name == "plain":
        if kind == "fsdp2":  # FSDP2 is driven by a plain GradScaler
            return torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=3)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, init_scale=2.0**16, growth_interval=3)
    import autoscale

    return autoscale.get_scaler(name, device=device, init_scale=2.0**16)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(kind: str, name: str, steps: int, dev_type: str) -> str:
    """The run on this rank; its output lines."""
    fp16 = kind == "fsdp1-fp16"
    rank, last = dist.get_rank(), dist.get_world_size() - 1  # the last rank's batch is bad
    device = torch.device(dev_type)
    if dev_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model, opt = build(kind, device)
    scaler = scaler_for(kind, name, dev_type)
    g = torch.Generator().manual_seed(1 + rank)
    skipped, out = [], []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if step == 4 and rank == last:
            x[0, 0] = math.inf
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        if fp16:  # FSDP's own float16, no autocast: a float16 loss, scaled in float16
            pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y.to(pred.dtype))
        else:
            with torch.autocast(dev_type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
        before = [local(p).detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        if step == SHARD_INF and rank == last:  # one element of rank 1's shard alone overflows
            next(local(p.grad) for p in model.parameters() if local(p.grad).numel())[0] = math.inf
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if all(torch.equal(b, local(p)) for b, p in zip(before, model.parameters())):
            skipped.append(step)
        out.append(f"RANK{rank} LOSS {step} {loss.item()!r}\n")
    weights = b"".join(local(p).detach().cpu().numpy().tobytes() for p in model.parameters())
    digest = hashlib.sha256(weights).hexdigest()
    skips = ",".join(map(str, skipped)) or "-"
    out.append(f"RANK{rank} END {type(scaler).__name__} {scaler.get_scale()} {skips} {digest}\n")
    return "".join(out)


def main() -> None:
    kind, name = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    dev_type = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    torch.set_num_threads(1)
    # FSDP before the group: torch.distributed.nn, which it imports, takes group.WORLD as a
    # default argument when imported, so an import after init_process_group keeps the default
    # group past destroy_process_group, its gloo threads alive to interpreter exit, where a rank
    # can abort ("terminate called without an active exception"), plain torch as well
    importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")

    dist.init_process_group("nccl" if dev_type == "cuda" else "gloo")
    out = train(kind, name, steps, dev_type)
    os.write(1, out.encode())  # one write: the ranks share the pipe
    # The sharded model, its DTensor parameters and the scaler hold the group too: they go
    # (with train's frame, and their reference cycles by a collection) before it
    gc.collect()
    rank = dist.get_rank()
    dist.destroy_process_group()
    os.write(1, f"RANK{rank} GLOO {gloo_threads()}\n".encode())


def gloo_threads(wait_s: float = 2.0) -> int:
    """Threads of a gloo group still running in this process, polled for up to ``wait_s``
    seconds until none is left (a joined thread's /proc entry can outlive the join briefly);
    -1 where /proc cannot tell."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return -1
    deadline = time.monotonic() + wait_s
    while True:
        names = []
        for t in os.listdir(tasks):
            try:
                with open(f"{tasks}/{t}/comm") as f:
                    names.append(f.read())
            except OSError:  # a thread that ended meanwhile
                pass
        left = sum(n.startswith(("gloo", "pt_gloo")) for n in names)
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


if __name__ == "__main__":
    main()
