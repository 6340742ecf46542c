"""A training script for the records search's tests: a plain fp16 loop under torch's own
GradScaler (its defaults), the loss weighted by 2^-WEIGHT_BITS so that most gradient elements sit
near fp16's underflow, a non-finite loss on every BAD_EVERY-th step and a loss 2^SPIKE_BITS times
larger (finite) on every SPIKE_EVERY-th step (0: none), and (SPREAD_BITS > 0) an fp32 parameter
of 256 elements whose gradients spread evenly in log2 over SPREAD_BITS bits below the others'.

usage: python tiny_loss.py STEPS [BAD_EVERY [WEIGHT_BITS [SPIKE_EVERY [SPIKE_BITS [SPREAD_BITS]]]]]
"""

import sys

import torch

args = [int(a) for a in sys.argv[1:]] + [0, 14, 0, 0, 0][len(sys.argv) - 2 :]
steps, bad_every, weight_bits, spike_every, spike_bits, spread_bits = args[:6]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
tail = torch.nn.Parameter(torch.zeros(256))
spread = 2.0 ** -torch.linspace(0, spread_bits, 256) if spread_bits else torch.zeros(256)
opt = torch.optim.SGD([*model.parameters(), tail], lr=0.01)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(steps):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * 2.0**-weight_bits
    loss = loss + (tail * spread).sum() * 2.0**-weight_bits  # fp32: its gradient is `spread`
    if bad_every and step % bad_every == bad_every - 1:
        loss = loss * float("inf")  # a bad batch: the loss itself is not finite
    elif spike_every and step % spike_every == spike_every - 1:
        loss = loss * 2.0**spike_bits  # a spike: large gradients, still finite
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
