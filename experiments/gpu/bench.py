"""CUDA benchmarks timed with CUDA events, side by side in one run.

* every rule's step against ``torch.amp.GradScaler``'s on the same fp16 loop (plain and fused AdamW;
  target <= 1.05);
* the instrumented step (``TrainingRun.step``: the scaler's statistics, the precision census) over a
  bare AMP step of the same model (target <= 1.05);
* the environment's step (``LossScaleEnv``) over the instrumented step (target <= 1.10).

Blocks of ``--steps`` steps alternate (the order flips every repeat); a block is timed by CUDA events
recorded before its first and after its last step, so the GPU's asynchrony is inside the block;
medians of the block ratios are printed.

    python experiments/gpu/bench.py [--model gpt2-tiny] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import autoscale  # noqa: E402

DEV = "cuda"


def block_ms(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def paired(a, b, steps: int, repeats: int) -> tuple[float, float, float]:
    """Median of a/b block-time ratios, and the medians of each (ms per step)."""
    ra, rb, ratios = [], [], []
    for r in range(repeats):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        t1, t2 = block_ms(first, steps), block_ms(second, steps)
        ta, tb = (t1, t2) if r % 2 == 0 else (t2, t1)
        ra.append(ta)
        rb.append(tb)
        ratios.append(ta / tb)
    return statistics.median(ratios), statistics.median(ra), statistics.median(rb)


def amp_loop(scaler, fused: bool, width: int = 2048, depth: int = 4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 16)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    x = torch.randn(256, width, device=DEV)
    y = torch.randn(256, 16, device=DEV)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=torch.float16):
            out = model(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(5):
        step()
    return step


def rules(steps: int, repeats: int) -> list[str]:
    names = [i.name for i in autoscale.list_scalers() if i.kind == "rule"]
    lines = [
        "| rule | optimizer | ms/step | GradScaler ms/step | ratio | <= 1.05 |",
        "|---|---|---|---|---|---|",
    ]
    for fused in (False, True):
        base = amp_loop(torch.amp.GradScaler(DEV), fused)
        for name in names:
            mine = amp_loop(autoscale.get_scaler(name, device=DEV), fused)
            ratio, ta, tb = paired(mine, base, steps, repeats)
            lines.append(
                f"| {name} | {'fused' if fused else 'adamw'} | {ta:.3f} | {tb:.3f} | {ratio:.3f} | "
                f"{'yes' if ratio <= 1.05 else 'NO'} |"
            )
    return lines


def instrumented(model: str, steps: int, repeats: int) -> list[str]:
    from autoscale.envs import LossScaleEnv
    from autoscale.envs.spec import EnvSpec
    from autoscale.training import TrainingRun, WorkloadSpec

    spec = WorkloadSpec(model=model, scenario="clean", dtype="fp16", device=DEV, init="random")
    run = TrainingRun(spec, "torch")
    bare_model = copy.deepcopy(run.model)
    opt = torch.optim.AdamW(bare_model.parameters(), lr=spec.lr, fused=True)
    scaler = torch.amp.GradScaler(DEV)
    data = run.data

    def bare():
        batch = data.next_batch()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEV, dtype=torch.float16):
            loss = data.loss(bare_model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        run.step()
        bare()
    r_step, t_step, t_bare = paired(run.step, bare, steps, repeats)
    env = LossScaleEnv(
        EnvSpec.from_dict(
            {
                "name": "gpu",
                "workload": spec.to_dict(),
                "episode": {"steps": 10**6},
                "instances": {"train": [0], "test": [1]},
            }
        )
    )
    env.reset(options={"instance": "train-s0-t0"})
    r_env, t_env, t_run = paired(lambda: env.step(2), env.run.step, steps, repeats)
    return [
        f"| instrumented step / bare AMP step ({model}) | {r_step:.3f} ({t_step:.2f} vs {t_bare:.2f} ms) | <= 1.05 | {'yes' if r_step <= 1.05 else 'NO'} |",
        f"| env step / instrumented step ({model}) | {r_env:.3f} ({t_env:.2f} vs {t_run:.2f} ms) | <= 1.10 | {'yes' if r_env <= 1.10 else 'NO'} |",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    lines = [
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        *instrumented(args.model, args.steps, args.repeats),
        *instrumented("gpt2", max(5, args.steps // 4), max(5, args.repeats // 2)),
        "",
        *rules(args.steps, args.repeats),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
