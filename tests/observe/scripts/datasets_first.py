# ruff: noqa: I001 - the import order is what is tested
"""The head of a Hugging Face example script (run_clm.py): datasets and evaluate imported before
torch (each looks torch up as it imports), GradScaler taken from torch.amp; it trains 6 fp16
steps (a non-finite batch at step 2) and checkpoints model, optimizer and scaler (``save PATH``)
or resumes from such a checkpoint for 6 more (``load PATH``)."""

import sys

import datasets  # noqa: F401
import evaluate  # noqa: F401
import torch
from torch.amp import GradScaler

what, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
g = torch.Generator().manual_seed(1)
if what == "load":
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    scaler.load_state_dict(state["scaler"])
    g.manual_seed(2)
    print("RESUMED", scaler.get_scale(), flush=True)
for step in range(6):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    if what == "save" and step == 2:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("LOSS", step, repr(loss.item()), scaler.get_scale(), flush=True)
if what == "save":
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, path
    )
    print("SAVED", scaler.get_scale(), flush=True)
print("SCALER", type(scaler).__name__, getattr(scaler, "name", "-"))
