"""Regenerate every study in experiments/results/ and the results block of the README.

For each configuration in experiments/configs/*.yaml:
  1. `autoscale search` on the config's env spec within its budget (studies in
     experiments/.cache/studies.db), exporting the winner to policies/auto-NAME;
  2. the winner, every built-in rule and a bf16 reference (same workload in bf16, unscaled) on the
     spec's TEST instances x `seeds` seeds, real steps;
  3. experiments/results/NAME.md, NAME.json and NAME.png.
Then the transfer study (a policy evaluated on workloads it never saw, `transfer_to`), a summary
table (experiments/results/summary.md), and the README block between the results markers.

    python experiments/reproduce.py [--only bad-batches ...] [--budget 2m] [--skip-search]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
CACHE = ROOT / "experiments" / ".cache"
BF16 = "bf16 (no scaling)"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def load_configs(only: list[str] | None) -> list[dict]:
    configs = []
    for path in sorted((ROOT / "experiments" / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if only and cfg["name"] not in only:
            continue
        configs.append(cfg)
    return configs


def search(cfg: dict, budget: str) -> str:
    name = f"auto-{cfg['name']}"
    cmd = [
        sys.executable,
        "-m",
        "autoscale.cli",
        "search",
        "--env",
        str(ROOT / cfg["env"]),
        "--budget",
        budget,
        "--space",
        cfg.get("space", "parametric"),
        "--storage",
        f"sqlite:///{CACHE / 'studies.db'}",
        "--study",
        f"experiments-{cfg['name']}",
        "--export",
        name,
        "--seed",
        str(cfg.get("seed", 0)),
        "--force",
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return name


def bf16_reference(spec, instances) -> tuple[list, list]:
    """The same test instances trained in bf16 with no loss scaling (scale 1)."""
    from autoscale.envs import LossScaleEnv  # noqa: F401  (keeps the import graph as in evaluate)
    from autoscale.training import TrainingRun

    cards, records = [], []
    for inst in instances:
        run = TrainingRun(
            spec.workload.replace(seed=inst.seed, dtype="bf16"), "static", init_scale=1.0
        )
        if inst.start:
            run.run(inst.start)
            run.records.clear()
        cards.append(run.run(spec.episode.steps))
        records.append(list(run.records))
    return cards, records


def evaluate(spec_path: str, policy: str, seeds: int, title: str, out: str):
    from autoscale.agents.evaluate import evaluate_scalers, expand_seeds
    from autoscale.envs import load_env_spec
    from autoscale.scalers import list_scalers
    from autoscale.training import summarize
    from autoscale.training.report import format_comparison, plot_comparison

    spec = load_env_spec(ROOT / spec_path)
    rules = [i.name for i in list_scalers() if i.kind == "rule"]
    cards, records = evaluate_scalers(
        spec, [policy] + rules, seeds=seeds, progress=True, keep_records=True
    )
    instances = expand_seeds(spec, seeds).instances["test"]
    cards[BF16], records[BF16] = bf16_reference(spec, instances)
    summaries = {k: summarize(v) for k, v in cards.items()}
    n = len(cards[policy])
    plot_comparison(records, RESULTS / f"{out}.png", title=title)
    table = format_comparison(summaries, n)
    from autoscale.training.scorecard import json_safe

    (RESULTS / f"{out}.json").write_text(
        json.dumps(
            json_safe(
                {
                    "spec": spec.to_dict(),
                    "policy": policy,
                    "episodes": n,
                    "summaries": summaries,
                    "scorecards": {k: [c.to_dict() for c in v] for k, v in cards.items()},
                }
            ),
            indent=2,
        )
        + "\n"
    )
    return spec, summaries, table, n


def verdict(summaries: dict, policy: str) -> str:
    p, t = summaries[policy], summaries["torch"]
    parts = []
    for key, label in (
        ("skip_rate", "skip rate"),
        ("precision_loss", "precision loss"),
        ("eval_loss", "eval loss"),
    ):
        a, b = p[key]["mean"], t[key]["mean"]
        if not (math.isfinite(a) and math.isfinite(b)):
            parts.append(f"{label}: n/a")
        elif math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            parts.append(f"{label}: equal")
        else:
            parts.append(f"{label}: {'lower' if a < b else 'higher'} ({a:.4g} vs {b:.4g})")
    return "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="*", help="config names to run (default: all)")
    p.add_argument("--budget", help="override every config's search budget (e.g. 2m)")
    p.add_argument(
        "--skip-search", action="store_true", help="evaluate the policies already exported"
    )
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary = [
        "| study | winner (policy) | vs torch on held-out seeds | episodes |",
        "|---|---|---|---|",
    ]
    transfer = ["| policy searched on | evaluated on | vs torch | episodes |", "|---|---|---|---|"]
    for cfg in load_configs(args.only):
        name = (
            f"auto-{cfg['name']}" if args.skip_search else search(cfg, args.budget or cfg["budget"])
        )
        from autoscale.scalers.manifest import read_manifest
        from autoscale.scalers.registry import find_policy

        manifest = read_manifest(find_policy(name))
        spec, summaries, table, n = evaluate(
            cfg["env"],
            name,
            cfg.get("seeds", 2),
            f"{cfg['name']}: held-out seeds, real steps",
            cfg["name"],
        )
        what = (
            f"{manifest.family} {manifest.parameters}"
            if manifest.kind == "parametric"
            else manifest.family
        )
        (RESULTS / f"{cfg['name']}.md").write_text(
            f"# {cfg['name']}\n\nSearched with `autoscale search --env {cfg['env']} --budget {args.budget or cfg['budget']} "
            f"--space {cfg.get('space', 'parametric')}`; winner `{name}`: {what}.\n\n"
            f"Held-out: {n} episodes of {spec.episode.steps} real steps (test instances x {cfg.get('seeds', 2)} seeds).\n\n"
            f"```\n{table}\n```\n\n![{cfg['name']}]({cfg['name']}.png)\n"
        )
        summary.append(
            f"| [{cfg['name']}](experiments/results/{cfg['name']}.md) | `{name}`: {what} | {verdict(summaries, name)} | {n} |"
        )
        for target in cfg.get("transfer_to", []):
            tname = Path(target).stem
            _, tsum, ttable, tn = evaluate(
                target,
                name,
                cfg.get("seeds", 2),
                f"{name} on {tname} (never seen)",
                f"transfer_{cfg['name']}_to_{tname}",
            )
            (RESULTS / f"transfer_{cfg['name']}_to_{tname}.md").write_text(
                f"# Transfer: {name} on {tname}\n\n```\n{ttable}\n```\n\n![transfer](transfer_{cfg['name']}_to_{tname}.png)\n"
            )
            transfer.append(
                f"| {cfg['name']} | [{tname}](experiments/results/transfer_{cfg['name']}_to_{tname}.md) | {verdict(tsum, name)} | {tn} |"
            )
    block = [
        START,
        "",
        f"Regenerated by `python experiments/reproduce.py` ({(time.monotonic() - t0) / 60:.0f} min on this machine).",
        "",
        *summary,
        "",
        "Transfer (policies on workloads they never saw):",
        "",
        *transfer,
        "",
        END,
    ]
    (RESULTS / "summary.md").write_text("\n".join(block[1:-1]) + "\n")
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START in text and END in text:
        text = text[: text.index(START)] + "\n".join(block) + text[text.index(END) + len(END) :]
        readme.write_text(text)
    print("\n".join(block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
