"""Speed of the environments, measured side by side in one run.

Prints:
  * ReplayEnv steps per second on one core (target >= 100,000);
  * LossScaleEnv step time over the bare instrumented step (TrainingRun.step) on the same
    workload, interleaved blocks, medians (target <= 1.10);
  * LossScaleEnv reset time over one training step (target <= 1).

    python experiments/benchmarks/env_speed.py [--env envs/gpt2-tiny.yaml] [--dtype bf16] [--out FILE]

The real-step comparison defaults to bf16 autocast, since emulated fp16 on a CPU makes every
step slow and hides the environment's own cost; pass --dtype fp16 on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def replay_speed(spec, steps: int) -> float:
    from autoscale.envs import ReplayEnv, record_trace

    trace = record_trace(spec, spec.episode.steps, None, instances=("train",))
    env = ReplayEnv(spec, trace)
    env.reset(seed=0)
    n_actions = env.action_space.n if hasattr(env.action_space, "n") else None
    t0 = time.perf_counter()
    for i in range(steps):
        action = i % n_actions if n_actions else [0.0]
        _, _, term, trunc, _ = env.step(action)
        if term or trunc:
            env.reset()
    return steps / (time.perf_counter() - t0)


def real_env_ratio(spec, blocks: int, block_steps: int) -> tuple[float, float, float, float]:
    from autoscale.envs import LossScaleEnv
    from autoscale.training import TrainingRun

    env = LossScaleEnv(spec, instances="train")
    env.reset(options={"instance": spec.instances["train"][0].name})
    bare = TrainingRun(spec.workload, "static", init_scale=spec.episode.init_scale)
    for _ in range(3):  # warm up both
        bare.step()
        env.step(2)
    env_t, bare_t, reset_t = [], [], []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(block_steps):
            bare.step()
        bare_t.append((time.perf_counter() - t0) / block_steps)
        t0 = time.perf_counter()
        env.reset(options={"instance": spec.instances["train"][0].name})
        reset_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(block_steps):
            env.step(2)
        env_t.append((time.perf_counter() - t0) / block_steps)
    step, env_step, reset = (
        statistics.median(bare_t),
        statistics.median(env_t),
        statistics.median(reset_t),
    )
    return env_step / step, reset / step, step, reset


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", default="envs/gpt2-tiny.yaml")
    p.add_argument(
        "--dtype", default="bf16", help="autocast dtype for the real-step comparison (default bf16)"
    )
    p.add_argument("--replay-steps", type=int, default=200_000)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--out", help="also write the results as markdown here")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    import dataclasses

    from autoscale.envs import load_env_spec

    spec = load_env_spec(args.env)
    spec = dataclasses.replace(spec, workload=spec.workload.replace(dtype=args.dtype))
    steps_s = replay_speed(spec, args.replay_steps)
    ratio, reset_ratio, step, reset = real_env_ratio(spec, args.blocks, args.block_steps)
    rows = [
        ("ReplayEnv steps/s (one core)", f"{steps_s:,.0f}", ">= 100,000", steps_s >= 100_000),
        (
            "LossScaleEnv step / bare step",
            f"{ratio:.3f} ({step * 1e3:.1f} ms bare)",
            "<= 1.10",
            ratio <= 1.10,
        ),
        (
            "LossScaleEnv reset / one step",
            f"{reset_ratio:.3f} ({reset * 1e3:.2f} ms)",
            "<= 1",
            reset_ratio <= 1.0,
        ),
    ]
    lines = [
        f"env speed on {spec.name} ({spec.workload.model}, {args.dtype}, torch {torch.__version__}, 1 thread)",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {'yes' if d else 'NO'} |" for a, b, c, d in rows],
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(
                "\n".join(
                    ["# Environment speed", "", "`python " + " ".join(sys.argv) + "`", "", *lines]
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
