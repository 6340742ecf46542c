# ruff: noqa: I001 - the import order is what is tested
"""The first line of a Hugging Face example script: transformers imported before torch (it looks
torch up with importlib.util.find_spec as it imports)."""

import transformers  # noqa: F401

import torch

scaler = torch.amp.GradScaler("cpu")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with torch.autocast("cpu", dtype=torch.float16):
    loss = model(torch.ones(2, 4)).float().pow(2).mean()
scaler.scale(loss).backward()
scaler.step(opt)
scaler.update()
print("SCALER", type(scaler).__name__, getattr(scaler, "name", "-"))
