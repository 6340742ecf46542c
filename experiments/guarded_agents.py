"""Agents with and without amax-loss's per-step loss guard, on spiky losses.

An agent acts on past steps; on spiky losses (the preference scenario) the gradient amax follows
the current step's loss, which it cannot see, and ``amax-loss``'s guard reads it when the loss is
scaled. ``episode.guard`` lets the agent set the base scale while the guard takes each spike
(docs/environments.md). This trains the same algorithm with and without the guard on the replay of the
same recorded runs, and measures both, ``amax-loss``, ``auto`` and ``torch`` on real steps of
fresh instances (never trained or selected on), at a longer episode than the agents trained on.

    OMP_NUM_THREADS=1 python experiments/guarded_agents.py            # about 10 minutes here
    OMP_NUM_THREADS=1 python experiments/guarded_agents.py --env envs/preference.yaml \\
        --algos ppo,dqn --timesteps 30000 --steps 256

Writes experiments/results/guarded_agents.md (and .json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--env", default=str(ROOT / "envs" / "preference.yaml"))
    p.add_argument("--algos", default="ppo,dqn", help="comma-separated SB3 algorithms")
    p.add_argument("--timesteps", type=int, default=30_000, help="replay steps of training each")
    p.add_argument("--record", type=int, default=512, help="recorded real steps per instance")
    p.add_argument("--steps", type=int, default=256, help="real steps of each held-out episode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "guarded_agents.md")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.agents.train import train_agent
    from autoscale.envs import record_trace
    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.spec import GuardSpec, InstanceSpec, load_env_spec
    from autoscale.search.objective import objective
    from autoscale.training import summarize

    spec = load_env_spec(args.env)
    work = ROOT / "experiments" / ".cache" / "guarded_agents"
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    trace = work / f"{spec.name}-{args.record}.npz"
    if not trace.is_file():
        record_trace(spec, args.record, trace, progress=True)  # train: to learn, test: to select
    timings["record"] = time.monotonic() - t0

    plain = dataclasses.replace(spec, episode=dataclasses.replace(spec.episode, guard=None))
    guarded = dataclasses.replace(
        spec, episode=dataclasses.replace(spec.episode, guard=GuardSpec())
    )
    policies: dict[str, Path] = {}
    for algo in [a.strip() for a in args.algos.split(",") if a.strip()]:
        for label, s in ((algo, plain), (f"{algo}+guard", guarded)):
            t0 = time.monotonic()
            name = f"{spec.name}-{label.replace('+', '-')}"
            res = train_agent(
                s, algo, args.timesteps, replay=trace, seed=args.seed, progress=True,
                export_name=name, export_dir=str(work / "policies"), force=True,
            )  # fmt: skip
            timings[f"train {label}"] = time.monotonic() - t0
            policies[label] = Path(res.policy_dir)
            print(f"{label}: trained in {timings[f'train {label}']:.0f} s", flush=True)

    # fresh instances (the test seeds + 1000: never trained on or selected on), real steps, longer
    # episodes than the agents saw
    fresh = tuple(
        InstanceSpec(f"{i.name}+fresh", i.seed + 1000, i.start) for i in plain.instances["test"]
    )
    test = dataclasses.replace(
        plain,
        episode=dataclasses.replace(plain.episode, steps=args.steps),
        instances={**plain.instances, "test": fresh},
    )
    factories = {"torch": lambda: scaler_for("torch", test)}
    for rule in ("amax-loss", "auto"):
        factories[rule] = lambda r=rule: scaler_for(r, test)
    for label, path in policies.items():
        factories[label] = lambda path=path: scaler_for(str(path), test)
    t0 = time.monotonic()
    cards = evaluate_scalers(test, factories, progress=True)
    timings["evaluate"] = time.monotonic() - t0
    ref = {spec.name: cards["torch"]}
    rows = []
    for label, cs in cards.items():
        s = {k: v["mean"] for k, v in summarize(cs).items()}
        obj = objective({spec.name: cs}, ref, spec.reward)
        rows.append((label, obj, s))
    rows.sort(key=lambda r: r[1])
    lines = [
        f"# Agents with and without the per-step loss guard: {spec.name}",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, 1 thread",
        "- command: `"
        + " ".join(
            ["OMP_NUM_THREADS=1 python experiments/guarded_agents.py", *(argv or sys.argv[1:])]
        )
        + "`",
        f"- trained on the replay of {args.record} recorded real steps of each train instance, "
        f"{args.timesteps} steps each, seed {args.seed}, the best of each run picked on the test "
        f"instances' replay; measured on real steps of {len(cards['torch'])} fresh instances "
        f"(the test seeds + 1000), {args.steps} steps each (the agents trained on episodes of "
        f"{spec.episode.steps})",
        "- objective: mean regret against torch on the same episodes plus the worst (lower is "
        "better; torch 0); times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        "",
        "| scaler | objective | skip rate | precision loss | eval loss | min scale | max scale |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, obj, s in rows:
        lines.append(
            f"| {label} | {obj:+.4f} | {100 * s['skip_rate']:.2f}% | "
            f"{100 * s['precision_loss']:.2f}% | {s['eval_loss']:.4f} | "
            f"2^{math.log2(s['min_scale']):.1f} | 2^{math.log2(s['max_scale']):.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "rows": [{"scaler": r[0], "objective": r[1], **r[2]} for r in rows],
                "timings": timings,
                "args": {k: str(v) for k, v in vars(args).items()},
            },
            indent=1,
        )
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
