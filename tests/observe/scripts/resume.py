"""A script autoscale never saw that checkpoints its GradScaler (``save PATH``) and resumes from
the checkpoint (``load PATH``), as training scripts do across preemptions."""

import sys

import torch

what, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
if what == "load":
    scaler.load_state_dict(torch.load(path, weights_only=True)["scaler"])
    print("RESUMED", scaler.get_scale(), flush=True)
g = torch.Generator().manual_seed(1)
for step in range(4):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    if what == "save" and step == 1:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
if what == "save":
    torch.save({"scaler": scaler.state_dict()}, path)
    print("SAVED", scaler.get_scale(), flush=True)
print("SCALER", type(scaler).__name__, getattr(scaler, "name", "-"))
