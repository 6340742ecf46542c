"""Speed of the environments, measured side by side in one run.

Prints:
  * ReplayEnv steps per second on one core (target >= 100,000), on short episodes driven by
    actions, and on long episodes (``--horizon`` steps, default 1024, on a trace of two horizons;
    at offset 0 and late, at ``--horizon``) driven as the search drives them: ``drive_episode``
    with a built-in rule (torch, amax-history) through a SuiteEnv, a fresh scaler per episode,
    scorecard and step records included;
  * LossScaleEnv step time over the bare instrumented step (TrainingRun.step) on the same
    workload, interleaved blocks, medians (target <= 1.10);
  * LossScaleEnv reset time over one training step (target <= 1).

    python experiments/benchmarks/env_speed.py [--env envs/gpt2-tiny.yaml] [--dtype bf16] \
        [--long-env envs/mlp-bad-batches.yaml] [--horizon 1024] [--long-trace FILE] [--out FILE]

The real-step comparison defaults to bf16 autocast, since emulated fp16 on a CPU makes every
step slow and hides the environment's own cost; pass --dtype fp16 on a GPU. The long episodes
replay an fp16 trace of ``--long-env`` (recorded here, or read from ``--long-trace`` if that file
exists, and written there otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


class Clocks:
    """Process CPU time and wall-clock time of a block, together.

    On a shared machine other processes take the core part of the time; CPU time is what the
    replay itself costs on one core, wall time what it took here. Both are reported."""

    def __enter__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall


def replay_speed(spec, steps: int) -> tuple[float, float]:
    """Steps/s (CPU, wall) of short episodes driven by actions through ``env.step``."""
    from autoscale.envs import ReplayEnv, record_trace

    trace = record_trace(spec, spec.episode.steps, None, instances=("train",))
    env = ReplayEnv(spec, trace)
    env.reset(seed=0)
    n_actions = env.action_space.n if hasattr(env.action_space, "n") else None
    with Clocks() as c:
        for i in range(steps):
            action = i % n_actions if n_actions else [0.0]
            _, _, term, trunc, _ = env.step(action)
            if term or trunc:
                env.reset()
    return steps / c.cpu, steps / c.wall


def long_trace(spec, horizon: int, path: str | None):
    """A trace of two horizons of the spec's first train instance (read from ``path`` if there)."""
    from autoscale.envs import Trace, record_trace

    inst = spec.instances["train"][0].name
    if path and os.path.exists(path):
        trace = Trace.load(path)
        same = trace.spec.get("workload") == spec.workload.to_dict()
        if same and inst in trace.instances and trace.instance(inst).steps >= 2 * horizon:
            return trace
    return record_trace(spec, 2 * horizon, path, instances=[inst])


def long_replay_speed(spec, trace, rules: list[str], episodes: int) -> list[tuple]:
    """Replayed steps per second of long episodes driven by ``rules``, as the search drives them
    (:func:`drive_episode` through a SuiteEnv, a fresh scaler per episode, scorecard and records
    included), at offset 0 and one horizon in: (rule, offset, CPU steps/s, wall steps/s), each
    the median over ``episodes`` timed episodes."""
    from autoscale.envs.episodes import drive_episode, scaler_for
    from autoscale.envs.suite_env import SuiteEnv

    inst = f"{spec.name}:{spec.instances['train'][0].name}"
    env = SuiteEnv(spec, "train", traces={spec.name: trace})
    h = spec.episode.steps
    out = []
    for rule in rules:
        for offset in (0, h):
            drive_episode(env, scaler_for(rule, spec), inst, offset)  # warm
            cpu, wall = [], []
            for _ in range(episodes):
                with Clocks() as c:
                    card, _ = drive_episode(env, scaler_for(rule, spec), inst, offset)
                cpu.append(c.cpu)
                wall.append(c.wall)
            steps = card.steps
            out.append(
                (rule, offset, steps / statistics.median(cpu), steps / statistics.median(wall))
            )
    return out


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


def previous(path: str) -> list[str]:
    """The command and the table of an earlier ``--out`` of this script."""
    from pathlib import Path

    text = Path(path).read_text().splitlines()
    command = next((line for line in text if line.startswith("`python")), "")
    table = [line for line in text if line.startswith("|")]
    # its own comparison, if any, starts a second table
    cut = next((i for i, line in enumerate(table[2:], 2) if line.startswith("| measure")), None)
    return [command, "", *(table[:cut] if cut else table)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", default="envs/gpt2-tiny.yaml")
    p.add_argument(
        "--dtype", default="bf16", help="autocast dtype for the real-step comparison (default bf16)"
    )
    p.add_argument("--replay-steps", type=int, default=200_000)
    p.add_argument(
        "--long-env", default="envs/mlp-bad-batches.yaml", help="spec of the long episodes (fp16)"
    )
    p.add_argument("--horizon", type=int, default=1024, help="long episode length (default 1024)")
    p.add_argument("--long-trace", help="trace file of the long episodes (read, or written)")
    p.add_argument("--episodes", type=int, default=15, help="timed long episodes per row")
    p.add_argument("--rules", nargs="+", default=["torch", "amax-history"])
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--out", help="also write the results as markdown here")
    p.add_argument(
        "--compare", help="a previous --out of this script (e.g. before a change): shown below"
    )
    p.add_argument("--compare-label", help="what --compare measured (default: its path)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    import dataclasses

    from autoscale.envs import load_env_spec

    spec = load_env_spec(args.env)
    spec = dataclasses.replace(spec, workload=spec.workload.replace(dtype=args.dtype))
    long_spec = load_env_spec(args.long_env)
    long_spec = dataclasses.replace(  # one instance, long episodes
        long_spec,
        episode=dataclasses.replace(long_spec.episode, steps=args.horizon, horizon=args.horizon),
        instances={**long_spec.instances, "train": long_spec.instances["train"][:1]},
    )
    trace = long_trace(long_spec, args.horizon, args.long_trace)
    long_rows = long_replay_speed(long_spec, trace, args.rules, args.episodes)
    cpu_s, wall_s = replay_speed(spec, args.replay_steps)
    ratio, reset_ratio, step, reset = real_env_ratio(spec, args.blocks, args.block_steps)
    rows = [
        (
            f"ReplayEnv, {spec.episode.steps}-step episodes driven by actions: steps/s",
            f"{cpu_s:,.0f} ({wall_s:,.0f} wall)",
            ">= 100,000",
            cpu_s >= 100_000,
        ),
        *(
            (
                f"{args.horizon}-step episodes at offset {off}, drive_episode with {rule}: steps/s",
                f"{cpu:,.0f} ({wall:,.0f} wall)",
                ">= 100,000",
                cpu >= 100_000,
            )
            for rule, off, cpu, wall in long_rows
        ),
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
        f"long episodes: replay of {long_spec.name} ({long_spec.workload.model}, "
        f"{long_spec.workload.dtype}), trace of {2 * args.horizon} steps, drive_episode through "
        f"a SuiteEnv, median of {args.episodes} episodes",
        "",
        "Replay rates are steps per second of process CPU time on one core (the wall-clock rate in "
        "parentheses: this machine is shared with other jobs; load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run).",
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {'yes' if d else 'NO'} |" for a, b, c, d in rows],
    ]
    if args.compare:
        label = args.compare_label or f"`{args.compare}`"
        lines += ["", f"## Compared with {label}", "", *previous(args.compare)]
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
