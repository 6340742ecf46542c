"""A training script written the way many users write theirs, not in autoscale's terms: it imports
transformers before torch, builds a small GPT-2 from a config (no download), trains it under fp16
autocast with torch's ``GradScaler`` and gradient clipping, keeps its own checkpoint (model,
optimizer, scaler, step; written to a temporary file and renamed) and resumes from one. Its data is
CPython's own documentation (``pydoc_data.topics``). It prints each step's loss as ``repr`` (every
bit) and, at the end, the sum of its weights.

    python hf_first_train.py --steps 40
    python hf_first_train.py --steps 1000 --ckpt ck.pt          # stopped by SIGTERM, say
    python hf_first_train.py --steps 260 --resume ck.pt

On a CPU it autocasts to fp16 on the CPU (``GradScaler("cpu")``); on a CUDA machine on the GPU.
"""

import transformers  # noqa: F401, I001  (first, before torch, as many Hugging Face scripts do)
from transformers import GPT2Config, GPT2LMHeadModel

import argparse
import os

import pydoc_data.topics as topics
import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ckpt", default=None)
p.add_argument("--resume", default=None)
p.add_argument("--save-every", type=int, default=20)
a = p.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
text = " ".join(topics.topics[k] for k in sorted(topics.topics)).encode()[:200_000]
data = torch.tensor(list(text), dtype=torch.long)
cfg = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                 bos_token_id=0, eos_token_id=0)  # fmt: skip
model = GPT2LMHeadModel(cfg).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
scaler = torch.amp.GradScaler(device, growth_interval=400)
start = 0
if a.resume:
    ck = torch.load(a.resume, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    scaler.load_state_dict(ck["scaler"])
    start = ck["step"]
    print(
        f"resumed at step {start}, scale {scaler.get_scale()}, {type(scaler).__name__}", flush=True
    )
g = torch.Generator().manual_seed(1)
for step in range(start, a.steps):
    g.manual_seed(1000 + step)
    idx = torch.randint(0, len(data) - 65, (8,), generator=g)
    x = torch.stack([data[i : i + 64] for i in idx]).to(device)
    with torch.autocast(device, dtype=torch.float16):
        loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item()!r} scale {scaler.get_scale()}", flush=True)
    if a.ckpt and (step + 1) % a.save_every == 0:
        state = {"model": model.state_dict(), "opt": opt.state_dict(),
                 "scaler": scaler.state_dict(), "step": step + 1}  # fmt: skip
        torch.save(state, a.ckpt + ".tmp")
        os.replace(a.ckpt + ".tmp", a.ckpt)
weights = torch.cat([t.detach().flatten().double() for t in model.parameters()])
print(f"weights sum {weights.sum().item()!r} scaler {type(scaler).__name__}", flush=True)
