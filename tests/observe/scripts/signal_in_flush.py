"""A training loop that gets a SIGTERM while the watch hands its pending steps to the record: the
signal is sent from inside the record's write (its handler then runs at the next bytecode, in the
middle of the watch's flush), as a job's SIGTERM lands on a loaded machine. Prints each step."""

import os
import signal

import torch

import autoscale.observe.watch as watch

write = watch.RecordSink.write


def write_signalled(self, rows):
    os.kill(os.getpid(), signal.SIGTERM)  # handled here, before the rows reach the record
    return write(self, rows)


watch.RecordSink.write = write_signalled
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(100):
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("STEP", step, flush=True)
