"""Evidence for learned policies: PPO against the torch rule on held-out instances, real steps.

For each scenario (default: bad-batches and small-grads on gpt2-tiny, fp16 autocast):
  1. record traces of the spec's train and test instances (real steps);
  2. train PPO on the replay of the TRAIN instances, within a CPU-time budget;
  3. export it to policies/ppo-SCENARIO (a registered scaler);
  4. evaluate it, the torch rule and amax-history on the TEST instances (never trained on) with
     real steps, --seeds seeds per instance;
  5. write experiments/results/ppo_evidence.{md,json} and a plot per scenario.

    python experiments/ppo_evidence.py [--scenarios bad-batches small-grads] [--timesteps 100000]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
CACHE = ROOT / "experiments" / ".cache"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", nargs="+", default=["bad-batches", "small-grads"])
    p.add_argument("--timesteps", type=int, default=100_000)
    p.add_argument("--trace-steps", type=int, default=192)
    p.add_argument(
        "--seeds", type=int, default=2, help="seeds per test instance for the real-step evaluation"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--readme-only",
        action="store_true",
        help="only rewrite the README block from the last results",
    )
    args = p.parse_args(argv)
    if args.readme_only:
        update_readme(json.loads((RESULTS / "ppo_evidence.json").read_text()))
        return 0

    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.agents.train import train_agent
    from autoscale.envs import Trace, load_env_spec, record_trace
    from autoscale.errors import ConfigError
    from autoscale.training import summarize
    from autoscale.training.report import format_comparison, plot_comparison
    from autoscale.training.scorecard import json_safe

    RESULTS.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    report = [
        "# PPO against the torch rule (held-out instances, real steps)",
        "",
        f"`python experiments/ppo_evidence.py {' '.join(argv or sys.argv[1:])}`",
        "",
    ]
    data = {}
    for scenario in args.scenarios:
        spec = load_env_spec(ROOT / "envs" / f"{scenario}.yaml")
        trace_path = CACHE / f"{scenario}-{args.trace_steps}.npz"
        t0 = time.perf_counter()
        try:
            trace = Trace.load(trace_path)
        except ConfigError:  # not recorded yet, or by another trace version
            trace = record_trace(spec, args.trace_steps, trace_path, progress=True)
        record_s = time.perf_counter() - t0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        name = f"ppo-{scenario}"
        result = train_agent(
            spec,
            "ppo",
            args.timesteps,
            replay=trace,
            seed=args.seed,
            progress=True,
            export_name=name,
            export_dir=str(ROOT / "policies"),
            force=True,
        )
        cpu_min, wall_min = (time.process_time() - cpu0) / 60, (time.perf_counter() - wall0) / 60
        cards, records = evaluate_scalers(
            spec,
            [str(result.policy_dir), "torch", "amax-history"],
            seeds=args.seeds,
            progress=True,
            keep_records=True,
        )
        cards = {name if k == str(result.policy_dir) else k: v for k, v in cards.items()}
        records = {name if k == str(result.policy_dir) else k: v for k, v in records.items()}
        summaries = {k: summarize(v) for k, v in cards.items()}
        n = len(cards[name])
        plot = RESULTS / f"ppo_evidence_{scenario}.png"
        plot_comparison(
            records, plot, title=f"{scenario}: PPO vs rules, test instances, real steps"
        )
        ppo, torch_ = summaries[name], summaries["torch"]
        verdict = {
            "lower_skip_rate": ppo["skip_rate"]["mean"] < torch_["skip_rate"]["mean"],
            "equal_skip_rate": math.isclose(ppo["skip_rate"]["mean"], torch_["skip_rate"]["mean"]),
            "lower_precision_loss": ppo["precision_loss"]["mean"]
            < torch_["precision_loss"]["mean"],
            "eval_loss_no_worse": ppo["eval_loss"]["mean"] <= torch_["eval_loss"]["mean"] + 1e-3,
        }
        data[scenario] = {
            "summaries": summaries,
            "verdict": verdict,
            "cpu_minutes": cpu_min,
            "wall_minutes": wall_min,
            "record_s": record_s,
            "timesteps": args.timesteps,
            "episodes": n,
            "scorecards": {k: [c.to_dict() for c in v] for k, v in cards.items()},
        }
        report += [
            f"## {scenario}",
            "",
            f"PPO: {args.timesteps} timesteps on the replay of {len(spec.instances['train'])} train instances "
            f"({args.trace_steps} recorded steps each, {record_s:.0f} s to record), "
            f"{cpu_min:.1f} CPU-minutes / {wall_min:.1f} wall-minutes of training. "
            f"Evaluated on {n} episodes of {spec.episode.steps} real steps (test instances x {args.seeds} seeds).",
            "",
            "```",
            format_comparison(summaries, n),
            "```",
            "",
            "Verdict against torch: "
            + ", ".join(
                f"{k.replace('_', ' ')}: {'yes' if v else 'no'}" for k, v in verdict.items()
            ),
            "",
            f"![{scenario}]({plot.name})",
            "",
        ]
        print(format_comparison(summaries, n))
    (RESULTS / "ppo_evidence.md").write_text("\n".join(report) + "\n")
    (RESULTS / "ppo_evidence.json").write_text(json.dumps(json_safe(data), indent=2) + "\n")
    update_readme(json.loads((RESULTS / "ppo_evidence.json").read_text()))
    print("\n".join(report))
    return 0


def _fmt(summary: dict, key: str, pct: bool = False) -> str:
    mean = summary[key]["mean"]
    if mean is None:
        return "n/a"
    return f"{100 * mean:.2f}%" if pct else f"{mean:.4g}"


def update_readme(data: dict) -> None:
    """Rewrite the README block between the evidence markers from the results JSON."""
    start, end = "<!-- evidence:start -->", "<!-- evidence:end -->"
    rows = [
        "| scenario | scaler | skip rate | precision loss | eval loss | min scale |",
        "|---|---|---|---|---|---|",
    ]
    for scenario, d in data.items():
        for name, s in d["summaries"].items():
            rows.append(
                f"| {scenario} | {name} | {_fmt(s, 'skip_rate', True)} | {_fmt(s, 'precision_loss', True)} | {_fmt(s, 'eval_loss')} | "
                f"2^{math.log2(s['min_scale']['mean']):.1f} |"
            )
    readme = ROOT / "README.md"
    text = readme.read_text()
    if start in text and end in text:
        block = "\n".join([start, *rows, end])
        readme.write_text(text[: text.index(start)] + block + text[text.index(end) + len(end) :])


if __name__ == "__main__":
    sys.exit(main())
