"""Why no rule beats ``torch`` on the spiky ``preference`` members: what limits the scale there.

Trains each member under the ``torch`` rule (GradScaler's defaults) with the recording
instruments on, and measures per applied step:

* the step's **overflow level**: the largest |x| of the backward pass at scale 1, over every fp16
  tensor it produced (activation gradients included) and the parameter gradients; a scale S
  overflows the step when level x S >= 65504 (the backward is linear in the scale);
* the **oracle scale**: the largest power of two that does not overflow the step (a rule with
  foresight of this one step), and the precision loss there, from the step's histogram of
  log2|g| (exact at powers of two), next to torch's at the scale it used;
* how far that level lies above the **parameter-gradient amax**, the statistic gradient-amax
  rules (``amax-history``, ``amax-cap``) read: a level above it is an overflow they cannot see;
* how well the **loss** predicts the gradient amax: the least-squares slope of log2 amax on
  log2 |loss| and the spread of what is left.

Precision loss is over the elements non-zero at torch's scale (the histogram's), as the scorecard
counts it, averaged over the applied steps whose gradients are not all zero (the scorecard also
averages in steps with all-zero gradients, as 0: its figure for torch is lower where there are
many, as on mlp/preference). Each member and seed also trains under ``--rule`` (``amax-loss``,
which reads the loss; the scorecard's skip rate and precision loss), drawn in the plot too. Writes experiments/results/preference_anatomy.md and a plot of one run per member
(preference_anatomy.png).

    python experiments/preference_anatomy.py [--steps 256] [--seeds 100,101,102]
                                             [--members gpt2-tiny/preference,...]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
FP16_MAX = 65504.0
DEFAULT_MEMBERS = (
    "gpt2-tiny/preference,mlp/preference,autoencoder/preference,gpt2-tiny/clean,mlp/small-grads"
)


def precision_at(hist, edges, log2_scale: int) -> float:
    """Share of the histogram's elements that underflow fp16's normal range at 2**log2_scale:
    |g| * S < 2**-14, i.e. floor(log2|g|) < -14 - log2 S (bins are 1-bit, at integer edges)."""
    limit = -14 - log2_scale
    return math.fsum(f for e, f in zip(edges, hist) if e + 1 <= limit)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys on xs and the standard deviation of the residuals."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    slope = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    resid = [y - my - slope * (x - mx) for x, y in zip(xs, ys)]
    return slope, statistics.pstdev(resid)


def measure(member, seed: int, steps: int) -> dict:
    """One torch run of ``member`` with ``seed``: per applied step, what limits the scale."""
    from autoscale.training import TrainingRun
    from autoscale.training.instruments import HIST_EDGES

    edges = list(HIST_EDGES)
    ep = member.episode
    run = TrainingRun(
        member.workload.replace(seed=seed),
        "torch",
        record=True,
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    out = {"steps": [], "check": 0.0}
    for i in range(steps):
        weight = run.scenario.loss_weight(i)  # the loss the scaler sees is the weighted one
        r = run.step()
        if r.found_inf:
            continue
        if r.grad_log2_hist is None or not (r.grad_amax > 0) or r.backward_amax is None:
            continue  # all-zero gradients: nothing to scale
        level = max(r.grad_amax, r.backward_amax / r.scale)
        oracle = math.floor(math.log2(FP16_MAX / level))
        used = math.log2(r.scale)
        # the histogram reproduces the census at torch's (power-of-two) scale
        out["check"] = max(
            out["check"], abs(precision_at(r.grad_log2_hist, edges, round(used)) - r.precision_loss)
        )
        loss = abs(r.loss * weight)
        out["steps"].append(
            {
                "step": i,
                "used": used,
                "oracle": oracle,
                "grad_limit": math.log2(FP16_MAX / r.grad_amax),
                "precision": r.precision_loss,
                "oracle_precision": precision_at(r.grad_log2_hist, edges, oracle),
                "hidden_bits": math.log2(level / r.grad_amax),
                "log2_loss": math.log2(loss) if loss > 0 else None,
                "log2_amax": math.log2(r.grad_amax),
            }
        )
    card = run.scorecard()
    out["skip"], out["card_precision"] = card.skip_rate, card.precision_loss
    return out


def under_rule(member, seed: int, steps: int, rule: str) -> dict:
    """The same run under ``rule``: its scorecard and the scale each step used."""
    from autoscale.training import TrainingRun

    ep = member.episode
    run = TrainingRun(
        member.workload.replace(seed=seed),
        rule,
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    card = run.run(steps)
    return {
        "skip": card.skip_rate,
        "precision": card.precision_loss,
        "scales": [(r.step, math.log2(r.scale)) for r in run.records],
    }


def summarize(name: str, runs: list[dict], ruled: list[dict]) -> dict:
    rows = [s for run in runs for s in run["steps"]]
    with_loss = [s for s in rows if s["log2_loss"] is not None]
    slope, spread = fit([s["log2_loss"] for s in with_loss], [s["log2_amax"] for s in with_loss])
    hidden = [s["hidden_bits"] for s in rows]
    return {
        "member": name,
        "skip": statistics.fmean(r["skip"] for r in runs),
        "card_precision": statistics.fmean(r["card_precision"] for r in runs),
        "precision": statistics.fmean(s["precision"] for s in rows),
        "oracle_precision": statistics.fmean(s["oracle_precision"] for s in rows),
        "headroom": statistics.median(s["oracle"] - s["used"] for s in rows),
        "oracle_spread": quantile([s["oracle"] for s in rows], 0.9)
        - quantile([s["oracle"] for s in rows], 0.1),
        "hidden_median": statistics.median(hidden),
        "hidden_p90": quantile(hidden, 0.9),
        "hidden_share": sum(h >= 1.0 for h in hidden) / len(hidden),
        "slope": slope,
        "spread": spread,
        "check": max(r["check"] for r in runs),
        "rule_skip": statistics.fmean(r["skip"] for r in ruled),
        "rule_precision": statistics.fmean(r["precision"] for r in ruled),
    }


def plot(runs: dict[str, dict], ruled: dict[str, dict], rule: str, path: Path) -> None:
    """One panel per member (its first seed): the oracle scale per step, the scale the gradient
    amax alone allows, torch's scale and ``rule``'s."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.8 * len(runs)), constrained_layout=True)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (name, run) in zip(axes, runs.items()):
        xs = [s["step"] for s in run["steps"]]
        ax.plot(xs, [s["grad_limit"] for s in run["steps"]], color="C2", lw=0.8,
                label="what the gradient amax allows")  # fmt: skip
        ax.plot(xs, [s["oracle"] for s in run["steps"]], color="C1", lw=1.0,
                label="largest scale that does not overflow (oracle)")  # fmt: skip
        ax.plot(xs, [s["used"] for s in run["steps"]], color="C0", lw=1.4, label="torch's scale")
        rx, ry = zip(*ruled[name]["scales"])
        ax.plot(rx, ry, color="C3", lw=0.9, label=f"{rule}'s scale")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylabel("log2 scale")
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step (applied steps)")
    fig.suptitle("What limits the loss scale, step by step (one seed per member, torch's run)")
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--seeds", default="100,101,102")
    p.add_argument("--members", default=DEFAULT_MEMBERS)
    p.add_argument("--rule", default="amax-loss", help="a scaler to run next to torch")
    p.add_argument("--out", default=str(RESULTS / "preference_anatomy.md"))
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from tqdm.auto import tqdm

    from autoscale.envs.suite import load_spec
    from autoscale.errors import ConfigError

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        members = [suite.member(m) for m in args.members.split(",")]
        from autoscale.scalers import make_scaler

        make_scaler(args.rule, device="cpu")
    except (ValueError, ConfigError) as exc:
        print(f"preference_anatomy.py: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    summaries, first, first_ruled = [], {}, {}
    bar = tqdm(total=2 * len(members) * len(seeds), desc="runs", unit="run")
    for m in members:
        runs, ruled = [], []
        for seed in seeds:
            runs.append(measure(m, seed, args.steps))
            bar.update(1)
            ruled.append(under_rule(m, seed, args.steps, args.rule))
            bar.update(1)
        first[m.name], first_ruled[m.name] = runs[0], ruled[0]
        summaries.append(summarize(m.name, runs, ruled))
    bar.close()
    out = Path(args.out)
    png = out.with_suffix(".png")
    plot(first, first_ruled, args.rule, png)
    lines = [
        "# What limits the loss scale on each member",
        "",
        f"`python experiments/preference_anatomy.py --steps {args.steps} --seeds {args.seeds} "
        f"--members {args.members} --rule {args.rule}` ({(time.monotonic() - t0) / 60:.1f} min; "
        f"{len(seeds)} seeds of {args.steps} real fp16 steps per member and scaler).",
        "",
        "- *precision, torch* / *precision, oracle*: share of non-zero gradient elements below "
        "fp16's normal range, at torch's scale and at the step's oracle scale (the largest power "
        "of two that does not overflow that step), over applied steps whose gradients are not "
        "all zero;",
        "- *oracle - torch*: median bits between the two scales; *oracle p90-p10*: how far the "
        "oracle scale swings from step to step (bits);",
        "- *hidden bits*: log2 of the overflow level over the parameter-gradient amax (median, "
        "90th percentile, share of steps with at least one bit): the part of the overflow "
        "threshold that rules reading the gradient amax do not see;",
        "- *loss slope* / *spread*: log2 gradient amax regressed on log2 |loss| (the loss the "
        "scaler sees), and the residual standard deviation in bits;",
        f"- *scorecard*: skip rate and precision loss as the scorecard defines them, of torch's "
        f"run and of {args.rule}'s on the same seeds.",
        "",
        "| member | precision, torch | precision, oracle | oracle - torch | oracle p90-p10 | "
        "hidden bits (median / p90 / share >= 1) | loss slope | spread | scorecard: skip, "
        f"precision, torch | scorecard: skip, precision, {args.rule} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['member']} | {100 * s['precision']:.2f}% | "
            f"{100 * s['oracle_precision']:.2f}% | {s['headroom']:+.0f} | {s['oracle_spread']:.0f} | "
            f"{s['hidden_median']:.1f} / {s['hidden_p90']:.1f} / {100 * s['hidden_share']:.0f}% | "
            f"{s['slope']:.2f} | {s['spread']:.1f} | {100 * s['skip']:.2f}%, "
            f"{100 * s['card_precision']:.2f}% | {100 * s['rule_skip']:.2f}%, "
            f"{100 * s['rule_precision']:.2f}% |"
        )
    check = max(s["check"] for s in summaries)
    lines += [
        "",
        f"Check: the histogram gives torch's precision loss to within {check:.1e} on every step "
        "(the census's exact count at the same scale).",
        "",
        f"![one run per member]({png.name})",
    ]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
