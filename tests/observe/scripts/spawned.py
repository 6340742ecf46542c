"""Processes started by torch.multiprocessing.spawn (no RANK, no LOCAL_RANK), each building its
GradScaler before init_process_group, as scripts autoscale never saw do; two GradScalers in the
first process (a second one for an auxiliary model) with ``two``."""

import os
import sys

import torch
import torch.multiprocessing as mp


def train(scaler, steps, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def worker(index, steps):
    scaler = torch.amp.GradScaler("cpu")
    train(scaler, steps, index)
    os.write(1, f"WORKER {index} {type(scaler).__name__}\n".encode())


if __name__ == "__main__":
    if sys.argv[1:] == ["two"]:
        first, second = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
        train(first, 6, 0)
        train(second, 4, 1)
        print("TWO", type(first).__name__, type(second).__name__)
    else:
        mp.spawn(worker, args=(5,), nprocs=2)
