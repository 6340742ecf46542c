"""A training script autoscale never saw: a plain fp16 loop with its own GradScaler, a non-finite
batch at step 5, a learning-rate schedule. Prints each step's loss, the scaler's class and a hash
of the final weights. ``plain.py [STEPS] [NAME]``: with NAME, the scaler is the program's own
``autoscale.get_scaler(NAME)`` instead."""

import hashlib
import sys

import torch

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
if len(sys.argv) > 2:
    import autoscale

    scaler = autoscale.get_scaler(sys.argv[2], device="cpu", init_scale=2.0**16)
else:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=2.0, growth_interval=50)
g = torch.Generator().manual_seed(1)
for step in range(steps):
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    if step == 5:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * 1e-3
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    print("LOSS", step, repr(loss.item()))
print("SCALER", type(scaler).__module__, type(scaler).__name__, getattr(scaler, "name", "-"))
print("ISINSTANCE", isinstance(scaler, torch.amp.GradScaler))
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print("WEIGHTS", digest.hexdigest())
