"""The training script behind the README's report screenshot: a small conv net on synthetic
images in fp16 autocast, with what users report from their own runs: a batch with a non-finite
input every 40 steps (a corrupt sample), a loss down-weighted by 2^-12 (an auxiliary loss), and a
learning-rate schedule that steps on every step. Unchanged by autoscale; run it as a user would::

    autoscale wrap --record runs/example -- python experiments/report_example.py [STEPS]
    autoscale report runs/example
"""

import sys

import torch

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 600
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(16, 32, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(32, 10),
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
scaler = torch.amp.GradScaler(device)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    x = torch.randn(32, 3, 16, 16, generator=g)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long() + 2 * (x[:, 1].mean(dim=(1, 2)) > 0).long()
    if step % 40 == 39:
        x[0, 0, 0, 0] = float("nan")
    x, y = x.to(device), y.to(device)
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y) * 2.0**-12
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    if step % 100 == 0:
        print(f"step {step}: loss {loss.item() * 2**12:.3f}, scale {scaler.get_scale():g}")
