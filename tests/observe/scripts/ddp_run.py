"""A DDP script autoscale never saw, for torchrun on CPU (gloo): fp16 autocast, its own
GradScaler, a non-finite batch at step 4 on rank 1 only."""

import gc
import hashlib
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1 + rank)
for step in range(10):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if step == 4 and rank == 1:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
# one write of the whole line: the ranks share the pipe (print writes its pieces one by one when
# the stream is unbuffered, and two ranks' pieces then interleave)
line = f"RANK{rank} {type(scaler).__name__} {scaler.get_scale()} {digest.hexdigest()}\n"
os.write(1, line.encode())
# DDP's reducer holds the process group: drop the model before the group, or the group's gloo
# threads are destroyed at interpreter exit, which aborts ("terminate called without an active
# exception") in about one run in four on a loaded machine, with or without autoscale
del model, opt
gc.collect()
dist.destroy_process_group()
