"""A training loop autoscale never saw that runs until a signal ends it: fp16 autocast, its own
GradScaler, a non-finite batch at step 5. ``own-before``: the program sets its own SIGTERM handler
before it imports torch (it stops the loop and exits 0); ``own-after``: the same, set after.
Prints its pid, then each step as it is taken (``STEP i``, flushed)."""

import os
import signal
import sys

mode = sys.argv[1] if len(sys.argv) > 1 else "default"
stop = []


def handler(signum, frame):
    stop.append(signum)
    print("HANDLER", signum, flush=True)


if mode == "own-before":
    signal.signal(signal.SIGTERM, handler)

import torch  # noqa: E402

if mode == "own-after":
    signal.signal(signal.SIGTERM, handler)
print("PID", os.getpid(), flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
step = 0
while not stop and step < 1_000_000:
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    if step == 5:
        x[0, 0] = float("inf")
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("STEP", step, flush=True)
    step += 1
print("STOPPED", step, flush=True)
