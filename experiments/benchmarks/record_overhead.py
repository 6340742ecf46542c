"""Cost of recording a run (``autoscale wrap --record``, ``get_scaler(..., record=DIR)``) against
the same scaler without it, on the same loop.

Each configuration trains its own copy of one model (same init, same batches) in one process:
the scaler alone; the scaler recording with the defaults (a gradient histogram every 8th step,
the overflow threshold estimated); recording with a histogram every step; and, with ``--measured``, recording with the threshold measured
from every fp16 tensor of the backward. Short blocks of steps alternate between them (the order
rotates every round), so drift in the machine's load hits all alike. A block's time is its mean
step (a block spans whole histogram periods); ratios are of the median block and, less sensitive
to other processes on a shared machine, of the lower quartiles.

    python experiments/benchmarks/record_overhead.py                     # gpt2-tiny and mlp-1m, bf16
    python experiments/benchmarks/record_overhead.py --scaler auto --measured
    python experiments/benchmarks/record_overhead.py --device cuda --dtype fp16

Target: default recording <= 1.10x. bf16 is the CPU default (fp16 products on a CPU are emulated
and slow, which would hide the overhead); with bf16 the measured-threshold mode finds no fp16
tensor to reduce, so its row is a lower bound there (``--dtype fp16`` gives the full cost).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import autoscale
from autoscale.observe import watch_scaler
from autoscale.training import TrainingRun, WorkloadSpec
from autoscale.training.run import AMP_DTYPES

TARGET = 1.10


def mlp_1m() -> torch.nn.Module:
    """1.1M parameters: 256 -> 1024 -> 768 -> 64."""
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 768),
        torch.nn.ReLU(),
        torch.nn.Linear(768, 64),
    )


def loops(args, workdir: Path) -> tuple[str, dict, list]:
    """(title, name -> step function, the watches to close): one step function per
    configuration, each on its own copy of the model."""
    device = args.device or autoscale.scalers.default_device()
    dtype = AMP_DTYPES[args.dtype]
    if args.model == "mlp-1m":
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(64, 256, generator=g).to(device) for _ in range(8)]
        ys = [torch.randn(64, 64, generator=g).to(device) for _ in range(8)]

        def build():
            torch.manual_seed(0)
            return mlp_1m().to(device)

        def loss_of(model, i):
            return torch.nn.functional.mse_loss(model(xs[i % 8]).float(), ys[i % 8])

        what = "mlp-1m (1.1M parameters), batch 64"
    else:
        run = TrainingRun(WorkloadSpec(model=args.model, dtype=args.dtype, device=device), "torch")
        batches = [run.data.next_batch() for _ in range(8)]
        data = run.data
        state = {k: v.clone() for k, v in run.model.state_dict().items()}

        def build():
            model = type(run.model)(run.model.config) if hasattr(run.model, "config") else None
            if model is None:
                import copy

                model = copy.deepcopy(run.model)
            model.load_state_dict(state)
            return model.to(device).train()

        def loss_of(model, i):
            return data.loss(model, batches[i % 8])

        what = f"{args.model}, batch {run.spec.batch_size}x{run.spec.seq_len}"

    configs = {
        "alone": {},
        "record": {"record": True},
        "record hist 1": {"record": True, "hist_every": 1},
    }
    if args.measured:
        configs["record+measured"] = {"record": True, "measure_threshold": True}
    out = {}
    watches = []
    for name, cfg in configs.items():
        model = build()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
        scaler = autoscale.get_scaler(args.scaler, device=device)
        if cfg.get("record"):
            watches.append(
                watch_scaler(
                    scaler,
                    record=str(workdir / name),
                    measure_threshold=cfg.get("measure_threshold", False),
                    hist_every=cfg.get("hist_every", 8),
                )
            )
        counter = [0]

        def step(model=model, opt=opt, scaler=scaler, params=params, counter=counter) -> float:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = loss_of(model, counter[0])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            counter[0] += 1
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        out[name] = step
    title = f"{what}, {args.dtype} on {device} ({torch.get_num_threads()} threads), scaler {args.scaler}"
    return title, out, watches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="mlp-1m, gpt2-tiny (default: both)")
    parser.add_argument("--scaler", default="torch")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of alternating blocks")
    parser.add_argument(
        "--block-steps", type=int, default=8, help="steps per block (a multiple of hist_every)"
    )
    parser.add_argument("--measured", action="store_true", help="also the measured threshold")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for model in args.model or ["mlp-1m", "gpt2-tiny"]:
        args.model = model
        with tempfile.TemporaryDirectory() as tmp:
            title, fns, watches = loops(args, Path(tmp))
            names = list(fns)
            for fn in fns.values():  # warm-up
                for _ in range(args.block_steps):
                    fn()
            times: dict[str, list[float]] = {k: [] for k in names}
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:  # the mean step of a block: histogram steps included
                    block = [fns[name]() for _ in range(args.block_steps)]
                    times[name].append(sum(block) / len(block))
            for watch in watches:
                watch.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items()}
        print(title)
        print(
            f"  {args.rounds} rounds of {args.block_steps}-step blocks; ms/step (mean of a block): median, lower quartile; ratio to alone"
        )
        for k in names:
            print(
                f"  {k:16s} {1000 * med[k]:8.2f} {1000 * low[k]:8.2f}   "
                f"{med[k] / med['alone']:6.3f} {low[k] / low['alone']:6.3f}"
                + (f"   (target <= {TARGET})" if k == "record" else "")
            )


if __name__ == "__main__":
    main()
