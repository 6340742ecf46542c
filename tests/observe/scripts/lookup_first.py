# ruff: noqa: I001 - the import order is what is tested
"""A script autoscale never saw that looks torch up before importing it, as ``transformers``,
``datasets`` and ``accelerate`` do at import (``importlib.util.find_spec("torch")``), then takes
GradScaler from its module (``from torch.amp.grad_scaler import GradScaler``)."""

import importlib.util

assert importlib.util.find_spec("torch") is not None
assert importlib.util.find_spec("torch") is not None  # twice: a lookup consumes nothing

import torch.nn  # noqa: E402
from torch.amp.grad_scaler import GradScaler  # noqa: E402

import torch  # noqa: E402

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(4):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("LOSS", step, repr(loss.item()))
cuda = torch.cuda.amp.GradScaler()  # deprecated, still in scripts; disabled without CUDA
print("SCALER", type(scaler).__name__, getattr(scaler, "name", "-"))
print(
    "ISINSTANCE",
    isinstance(scaler, torch.amp.GradScaler),
    isinstance(cuda, torch.cuda.amp.GradScaler),
)
