"""A finite loss spike: what ``torch`` (GradScaler's rule) and ``auto`` do with it.

GradScaler drops a step whose scaled gradients overflow; a loss spike (a batch whose loss is
finite but thousands of times the others) overflows at a high scale, so GradScaler drops it as
a side effect and halves the scale. ``auto``'s guard lowers that step's own scale from its loss
so that it does not overflow (docs/rules.md, ``amax-loss``): the spike is applied, as it would be
in fp32 or bf16. Where the spike's update is large (plain SGD), the run can diverge: weights blown
up by it give later losses so large that their gradients overflow fp16 even at the minimum scale,
and every later step is skipped.

Each run trains the 1.4k-parameter MLP of ``tests/observe/helpers.py`` (fp16 autocast on the CPU)
for ``--steps`` steps with the loss times ``SPIKE`` every ``--every`` steps, per optimizer,
learning rate, spike size, and without or with the unscaled gradients clipped to norm 1; columns: steps skipped, the longest run of consecutive skipped
steps, the scale at the end, the last step's loss, the largest weight, and the fp32 loss on a
held-out batch at the end.

A scaler may carry rule settings after a colon: ``auto:spike_bits=8`` is ``auto`` whose guard
skips loss spikes (docs/rules.md, ``amax-loss``).

Usage::

    python experiments/spike_harm.py --scalers torch,auto,auto:spike_bits=8 \
        --out experiments/results/spike_harm.md
"""

from __future__ import annotations

import argparse
import math
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch

import autoscale


def scaler_of(text: str) -> autoscale.LossScaler:
    """``NAME`` or ``NAME:key=value,...`` (rule settings) as a CPU scaler from 2^16."""
    name, _, rest = text.partition(":")
    settings = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        settings[key] = float(value) if "." in value or "e" in value else int(value)
    return autoscale.get_scaler(name, device="cpu", init_scale=2.0**16, **settings)


def run(
    name: str, opt_name: str, lr: float, spike: float, steps: int, every: int, clip: bool = False
) -> dict:
    """One run of scaler ``name`` (:func:`scaler_of`); ``clip``: the unscaled gradients clipped
    to norm 1 before each step."""
    scaler = scaler_of(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    skipped, last_loss = [], math.nan
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step % every == every - 1:
            loss = loss * spike
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        if scaler.step_was_skipped:
            skipped.append(step)
        last_loss = loss.item()
    longest, current, last = 0, 0, None
    for s in skipped:
        current = current + 1 if last == s - 1 else 1
        longest, last = max(longest, current), s
    h = torch.Generator().manual_seed(99)
    x, y = torch.randn(256, 16, generator=h), torch.randn(256, 4, generator=h)
    with torch.no_grad():
        held_out = torch.nn.functional.mse_loss(model(x), y).item()
    return {
        "skipped": len(skipped),
        "longest": longest,
        "scale": scaler.get_scale(),
        "held_out": held_out,
        "last_loss": last_loss,
        "max_weight": max(p.detach().abs().max().item() for p in model.parameters()),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--every", type=int, default=15, help="a spike every this many steps")
    p.add_argument(
        "--scalers",
        default="torch,auto",
        help="comma-separated, each NAME or NAME:key=value (';' between settings)",
    )
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    names = [n.replace(";", ",") for n in args.scalers.split(",") if n]
    torch.set_num_threads(1)
    rows = [
        "| optimizer | lr | clip | spike | rule | skipped | longest skipped run | scale at end "
        "| last step's loss | largest weight | held-out loss (fp32) |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for opt_name, lr in (("sgd", 0.01), ("sgd", 0.001), ("adamw", 0.001)):
        for clip in (False, True):
            for spike in (1e2, 1e3, 1e4):
                for name in names:
                    r = run(name, opt_name, lr, spike, args.steps, args.every, clip)
                    rows.append(
                        f"| {opt_name} | {lr:g} | {'norm 1' if clip else '-'} | {spike:g} | "
                        f"{name} | {r['skipped']} of "
                        f"{args.steps} | {r['longest']} | 2^{math.log2(r['scale']):.0f} | "
                        f"{r['last_loss']:.4g} | {r['max_weight']:.3g} | {r['held_out']:.4g} |"
                    )
    head = [
        f"# A finite loss spike under {', '.join(names)}",
        "",
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, autoscale "
        f"{autoscale.__version__}, {platform.machine()}, CPU, 1 thread",
        f"- `python experiments/spike_harm.py --scalers {args.scalers}` ({args.steps} steps, "
        "the loss times the spike "
        f"every {args.every} steps from step {args.every - 1})",
        "",
    ]
    text = "\n".join(head + rows) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
