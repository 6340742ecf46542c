"""What skipping loss spikes costs where large losses are the work: long real runs, side by side.

``amax-loss``'s ``spike_bits`` (docs/rules.md) skips a step whose finite ``|loss|`` is more than
that many bits above the largest of the last ``spike_memory`` steps taken. spike_harm.md shows
what it saves (the spikes GradScaler's overflow drops, which ``auto`` takes and which can diverge
an unclipped SGD run); spike_jump_memory256.md measured, on ``auto``'s steps, which suite steps
such a test would flag. This trains each member (by default the five whose losses jump at all)
for ``--steps`` real steps under each scaler on one seed, and reports per scaler the skip rate,
the steps skipped as spikes, the precision loss and the eval loss: the cost, not an estimate
(a skipped step changes the steps after it).

    python experiments/spike_cost.py [--steps 2000] [--seed 100]
                                     [--scalers torch,auto,auto:spike_bits=8]
                                     [--members a,b] [--out experiments/results/spike_cost.md]

A scaler may carry settings after a colon, ``;`` between them (``auto:spike_bits=8;spike_run=3``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
sys.path.insert(0, str(ROOT / "experiments"))
# the members whose losses jump at all against 256 taken losses (spike_jump_memory256.md)
JUMPY = (
    "gpt2-tiny/preference",
    "gpt2-tiny/rl-finetune",
    "mlp/preference",
    "mlp/token-sum",
    "autoencoder/preference",
)


def one_run(member, seed: int, steps: int, text: str) -> dict:
    """``steps`` real steps of ``member`` on ``seed`` under the scaler ``text``."""
    from eval_noise import parse_scaler

    from autoscale.training import TrainingRun

    name, settings = parse_scaler(text)
    ep = member.episode
    run = TrainingRun(
        member.workload.replace(seed=seed),
        name,
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
        **settings,
    )
    card = run.run(steps)
    spiked = [r.step for r in run.records if r.stats.spiked]
    return {
        "skip": card.skip_rate,
        "spiked": spiked,
        "precision": card.precision_loss,
        "eval": card.eval_loss,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--scalers", default="torch,auto,auto:spike_bits=8")
    p.add_argument("--members", default=",".join(JUMPY), help="comma-separated suite members")
    p.add_argument("--out", default=str(RESULTS / "spike_cost.md"))
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from tqdm.auto import tqdm

    import autoscale
    from autoscale.envs.suite import load_spec
    from autoscale.errors import AutoscaleError

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    scalers = [s for s in args.scalers.split(",") if s]
    try:
        members = [suite.member(m) for m in args.members.split(",") if m]
        for s in scalers:  # every scaler builds before an hour of runs
            name, settings = __import__("eval_noise").parse_scaler(s)
            autoscale.get_scaler(name, device="cpu", **settings)
    except AutoscaleError as exc:
        print(f"spike_cost.py: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    rows = []
    with tqdm(total=len(members) * len(scalers), desc="runs", unit="run") as bar:
        for m in members:
            for s in scalers:
                rows.append((m.name, s, one_run(m, args.seed, args.steps, s)))
                bar.update()
    minutes = (time.monotonic() - t0) / 60
    lines = [
        "# Skipping loss spikes: the cost on long real runs",
        "",
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, autoscale "
        f"{autoscale.__version__}, {platform.machine()}, CPU, 1 thread",
        f"- `python experiments/spike_cost.py --steps {args.steps} --seed {args.seed} "
        f"--scalers {args.scalers} --members {args.members}` ({minutes:.1f} min)",
        "",
        "Per member and scaler, one run of real steps on the same seed: the share of steps "
        "skipped (overflows, bad batches and spikes), the steps skipped as loss spikes, the "
        "precision loss and the eval loss at the end (the scorecard's).",
        "",
        "| member | scaler | skipped | skipped as spikes | precision loss | eval loss |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name, s, r in rows:
        spikes = r["spiked"]
        where = (
            f"{len(spikes)} (steps {', '.join(map(str, spikes[:8]))}"
            f"{', ...' if len(spikes) > 8 else ''})"
            if spikes
            else "0"
        )
        lines.append(
            f"| {name} | {s} | {100 * r['skip']:.2f}% | {where} | "
            f"{100 * r['precision']:.3f}% | {r['eval']:.4g} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
