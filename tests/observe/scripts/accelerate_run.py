"""An Accelerate script autoscale never saw: Accelerator(mixed_precision="fp16"), a non-finite
batch at step 3. Accelerate builds its GradScaler for fp16 only on a GPU (on a CPU: none)."""

import hashlib

import torch
from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="fp16")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = accelerator.prepare(model, opt)
g = torch.Generator().manual_seed(1)
for step in range(8):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if step == 3:
        x[0, 0] = float("inf")
    x, y = x.to(accelerator.device), y.to(accelerator.device)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    opt.step()
    print("LOSS", step, repr(loss.item()))
scaler = accelerator.scaler
print("SCALER", type(scaler).__module__, type(scaler).__name__, getattr(scaler, "name", "-"))
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
print("WEIGHTS", digest.hexdigest())
