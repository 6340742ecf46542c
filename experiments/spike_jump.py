"""Can a rule tell a harmful loss spike from a preference step by how far its loss jumps?

``experiments/spike_harm.py`` found that ``auto`` takes a finite loss spike GradScaler drops by
its overflow, and that under plain SGD without clipping a spike of 1000x (10 bits above the
other steps' losses) diverges the run. A guard that skipped every step whose ``|loss|`` lies more
than ``k`` bits above the largest ``|loss|`` of the last 16 steps (the guard's own memory) would
drop such spikes; what would it cost where the spikes are the work, as on the preference
members? This trains every suite member under ``auto`` on its real steps and counts, per ``k``,
the share of steps such a test would have skipped (the loss the scaler sees: the scenario's
weight applied; steps with a non-finite loss are the scenario's bad batches, skipped anyway, and
are not counted), beside ``torch``'s skip rate on the same seed; and, per ``k``, the members
where those skips would lift ``auto``'s skip rate above ``torch``'s.

    python experiments/spike_jump.py [--steps 2000] [--seed 100] [--reference torch]
                                     [--memory 16] [--members a,b]
                                     [--out experiments/results/spike_jump.md]

``--memory`` measures each jump against a longer (or shorter) memory than the guard's 16.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
BITS = (4, 6, 8, 10, 12, 16)
GUARD_MEMORY = 16  # auto's guard_history: the losses its guard remembers


def jumps(
    member, seed: int, steps: int, scaler: str, memory: int
) -> tuple[list[tuple[float, bool]], float]:
    """Per step with a finite non-zero loss after the first: log2 of its |loss| over the largest
    of the previous ``memory`` such ones (the report's :func:`loss_jumps`, its memory set to
    ``memory``), and whether the
    scaler skipped it; and the share of all steps the scaler skipped."""
    from autoscale.report.findings import loss_jumps
    from autoscale.training import TrainingRun

    ep = member.episode
    run = TrainingRun(
        member.workload.replace(seed=seed),
        scaler,
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    losses, skipped = [], []
    for i in range(steps):
        weight = run.scenario.loss_weight(i)
        r = run.step()
        losses.append(abs(r.loss * weight))
        skipped.append(bool(r.found_inf))
    js = loss_jumps(losses, memory=memory)
    out = [(float(j), s) for j, s in zip(js, skipped) if not math.isnan(j)]
    return out, run.scorecard().skip_rate


def reading(rows: list, scaler: str, reference: str) -> list[str]:
    """What the table says for a guard that skips at each threshold: per threshold, the members
    where the steps it would add to ``scaler``'s skips (on this run's steps: a skip changes the
    steps after it, so to first order) lift its skip rate above ``reference``'s."""
    out = [
        "A guard skipping every step above a threshold, on the steps of these runs (a skip changes "
        f"the later steps: to first order), would leave `{scaler}`'s skip rate above "
        f"`{reference}`'s on these members, at the rate given (its own skips plus the flagged "
        f"steps it took, each counted once, of all steps) against {reference}'s:",
        "",
    ]
    for i, k in enumerate(BITS):
        over = [
            f"{name} ({100 * (skipped + added[i]):.2f}% against {100 * ref:.2f}%)"
            for name, _, skipped, ref, _, _, added in rows
            if added[i] > 0 and skipped + added[i] > ref
        ]
        out.append(f"- above {k} bits ({2**k:g}x): {'; '.join(over) if over else 'no member'}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--scaler", default="auto")
    p.add_argument("--reference", default="torch", help="a scaler whose skip rate is shown beside")
    p.add_argument("--members", default="", help="comma-separated (default: every member)")
    p.add_argument(
        "--memory", type=int, default=0, help="losses a jump is measured against (default: 16)"
    )  # 16: auto's guard_history
    p.add_argument("--out", default=str(RESULTS / "spike_jump.md"))
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from tqdm.auto import tqdm

    import autoscale
    from autoscale.envs.suite import load_spec
    from autoscale.errors import ConfigError

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    try:
        names = (
            args.members.split(",")
            if args.members
            else [m.name for m in suite.members + suite.left_out]
        )
        members = [suite.member(m) for m in names]
    except ConfigError as exc:
        print(f"spike_jump.py: error: {exc}", file=sys.stderr)
        return 2
    memory = args.memory or GUARD_MEMORY
    t0 = time.monotonic()
    rows = []
    for m in tqdm(members, desc="members", unit="member"):
        js, skipped = jumps(m, args.seed, args.steps, args.scaler, memory)
        _, ref_skipped = jumps(m, args.seed, args.steps, args.reference, memory)
        shares = [sum(j > k for j, _ in js) / len(js) if js else math.nan for k in BITS]
        # the skip rate with the steps above k skipped too (those it skipped anyway count once)
        added = [sum(j > k and not s for j, s in js) / args.steps for k in BITS]
        top = max((j for j, _ in js), default=math.nan)
        rows.append((m.name, len(js), skipped, ref_skipped, top, shares, added))
    minutes = (time.monotonic() - t0) / 60
    head = " | ".join(f"> {k} bits" for k in BITS)
    lines = [
        "# Loss jumps: what a loss-only spike test would skip",
        "",
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, autoscale "
        f"{autoscale.__version__}, {platform.machine()}, CPU, 1 thread",
        f"- `python experiments/spike_jump.py --steps {args.steps} --seed {args.seed} "
        f"--scaler {args.scaler} --reference {args.reference}"
        + (f" --memory {args.memory}" if args.memory else "")
        + (f" --members {args.members}" if args.members else "")
        + (f" --out {args.out}" if Path(args.out) != RESULTS / "spike_jump.md" else "")
        + f"` ({minutes:.1f} min)",
        "",
        f"Per member, under `{args.scaler}`: the steps with a finite non-zero loss (after the "
        f"first), the share of all steps `{args.scaler}` skipped and `{args.reference}` skipped "
        "on the same seed, the largest jump (log2 of a step's |loss| over the largest of the "
        f"previous {memory}), and the share of those steps whose jump exceeds each "
        "threshold, which a guard skipping such steps would skip. spike_harm.md's harmful spikes "
        "were 1000x and 10000x (about 10 and 13 bits); its 100x spikes (6.6 bits) did no harm "
        "when taken under SGD.",
        "",
        f"| member | steps | skipped, {args.scaler} | skipped, {args.reference} | largest jump "
        f"(bits) | {head} |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(BITS),
    ]
    for name, n, skipped, ref_skipped, top, shares, _ in rows:
        cells = " | ".join(f"{100 * s:.1f}%" for s in shares)
        lines.append(
            f"| {name} | {n} | {100 * skipped:.2f}% | {100 * ref_skipped:.2f}% | {top:.1f} | {cells} |"
        )
    lines += ["", *reading(rows, args.scaler, args.reference)]
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
