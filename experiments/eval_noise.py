"""How much of a difference in eval loss is seed noise: paired episodes of one suite member.

build_auto.py's bar allows a candidate's mean eval loss over three held-out episodes to exceed
torch's by the spread of torch's three (their seed noise). On members whose eval loss scatters
widely that spread is itself a noisy estimate, and three episodes say little. This runs
``--seeds`` episodes of one member (fresh seeds from ``--first-seed``, the member's start point,
real steps) under torch and each scaler, and reports per scaler the paired difference in eval
loss against torch (mean, its standard error, on how many seeds it is lower), with skip rate and
precision loss. Writes experiments/results/eval_noise.md (``--out``).

    python experiments/eval_noise.py [--member gpt2-tiny/preference] [--seeds 12]
                                     [--first-seed 2000] [--steps 256]
                                     [--scalers amax-loss:probe_after=8,amax-loss,amax-cap]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
sys.path.insert(0, str(ROOT / "experiments"))


def parse_scaler(text: str) -> tuple[str, dict]:
    """``rule`` or ``rule:key=value;key=value`` (values int, else float)."""
    if ":" not in text:
        return text, {}
    rule, kv = text.split(":", 1)
    params = {}
    for part in kv.split(";"):
        key, _, value = part.partition("=")
        try:
            params[key] = int(value)
        except ValueError:
            params[key] = float(value)
    return rule, params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--member", default="gpt2-tiny/preference")
    p.add_argument("--seeds", type=int, default=12)
    p.add_argument("--first-seed", type=int, default=2000)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--scalers", default="amax-loss:probe_after=8,amax-loss,amax-cap")
    p.add_argument("--out", default=str(RESULTS / "eval_noise.md"))
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error(f"--seeds must be at least 2 (a standard error needs two), got {args.seeds}")

    import torch

    torch.set_num_threads(1)
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.spec import InstanceSpec
    from autoscale.envs.suite import load_spec
    from autoscale.errors import ConfigError
    from autoscale.training.bar import mean

    suite = load_spec(ROOT / "envs" / "suite.yaml").with_episode_steps(args.steps)
    try:
        member = suite.member(args.member)
    except (ConfigError, KeyError) as exc:
        p.error(f"--member {args.member}: {exc}")
    start = member.instances["test"][0].start
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    member = dataclasses.replace(
        member,
        instances={
            **member.instances,
            "test": tuple(InstanceSpec(f"seed{s}", s, start) for s in seeds),
        },
    )
    labels = ["torch", *[s for s in args.scalers.split(",") if s]]
    factories = {}
    for label in labels:
        rule, params = parse_scaler(label)
        try:
            scaler_for(rule, member, **params)
        except Exception as exc:
            p.error(f"--scalers {label}: {exc}")
        factories[label] = lambda r=rule, kw=params: scaler_for(r, member, **kw)
    t0 = time.monotonic()
    cards = evaluate_scalers(member, factories)
    took = time.monotonic() - t0

    ref = [c.eval_loss for c in cards["torch"]]
    rows = []
    for label in labels:
        evals = [c.eval_loss for c in cards[label]]
        diffs = [a - b for a, b in zip(evals, ref)]
        se_diff = statistics.stdev(diffs) / math.sqrt(len(diffs))
        rows.append(
            f"| {label} | {statistics.mean(evals):.4g} | {statistics.median(evals):.4g} | "
            + (
                "(the reference) | | |"
                if label == "torch"
                else f"{statistics.mean(diffs):+.4f} | {se_diff:.4f} | "
                f"{sum(d < 0 for d in diffs)} of {len(diffs)} |"
            )
            + f" {100 * mean(cards[label], 'skip_rate'):.2f}% | "
            f"{100 * mean(cards[label], 'precision_loss'):.2f}% |"
        )
    spread3 = [max(ref[i : i + 3]) - min(ref[i : i + 3]) for i in range(0, len(ref) - 2, 3)]
    lines = [
        f"# Seed noise of eval loss: {args.member}",
        "",
        "`python experiments/eval_noise.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
        f"{args.seeds} episodes (seeds {seeds[0]}-{seeds[-1]}, start step {start}) of "
        f"{args.steps} real steps under each scaler, {took / 60:.1f} min. Eval loss difference: "
        "the scaler's minus torch's on the same seed.",
        "",
        "| scaler | eval loss, mean | median | difference vs torch, mean | its standard error | "
        "lower than torch on | skip rate | precision loss |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The spread of torch's eval loss over consecutive groups of three seeds (the noise "
        "build_auto.py's bar allows on three episodes): "
        + ", ".join(f"{s:.3g}" for s in spread3)
        + ".",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
