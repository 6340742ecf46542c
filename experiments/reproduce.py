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
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            parts.append(f"{label}: n/a")
        elif math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            parts.append(f"{label}: equal")
        else:
            parts.append(f"{label}: {'lower' if a < b else 'higher'} ({a:.5g} vs {b:.5g})")
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
    p.add_argument(
        "--readme-only", action="store_true", help="only rebuild the summary and README block"
    )
    p.add_argument(
        "--transfer-only",
        action="store_true",
        help="only the transfer evaluations, of exported policies",
    )
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for cfg in [] if args.readme_only else load_configs(args.only):
        if args.transfer_only:
            run_transfers(cfg, f"auto-{cfg['name']}", cfg.get("seeds", 2))
        else:
            run_config(cfg, args)
    write_summary()
    print(f"took {(time.monotonic() - t0) / 60:.0f} min")
    return 0


def run_config(cfg: dict, args: argparse.Namespace) -> None:
    budget = args.budget or cfg["budget"]
    name = f"auto-{cfg['name']}" if args.skip_search else search(cfg, budget)
    what = describe_policy(name)
    seeds = cfg.get("seeds", 2)
    spec, _, table, n = evaluate(
        cfg["env"], name, seeds, f"{cfg['name']}: held-out seeds, real steps", cfg["name"]
    )
    _annotate(cfg["name"], winner=what, budget=budget)
    (RESULTS / f"{cfg['name']}.md").write_text(
        f"# {cfg['name']}\n\nSearched with `autoscale search --env {cfg['env']} --budget {budget} "
        f"--space {cfg.get('space', 'parametric')}`; winner `{name}`: {what}.\n\n"
        f"Held-out: {n} episodes of {spec.episode.steps} real steps (test instances x {seeds} seeds), "
        f"every built-in rule and a bf16 reference.\n\n```\n{table}\n```\n\n![{cfg['name']}]({cfg['name']}.png)\n"
    )
    run_transfers(cfg, name, seeds)


def run_transfers(cfg: dict, name: str, seeds: int) -> None:
    """Evaluate the study's winner (and ``transfer_also`` policies) on the ``transfer_to`` specs."""
    for target in cfg.get("transfer_to", []):
        for policy in [name, *cfg.get("transfer_also", [])]:
            out = transfer_name(cfg["name"], policy, target)
            title = f"{policy} on {Path(target).stem} (never seen)"
            _, _, ttable, _ = evaluate(target, policy, seeds, title, out)
            (RESULTS / f"{out}.md").write_text(
                f"# Transfer: {policy} (made for {cfg['name']}) on {Path(target).stem}\n\n```\n{ttable}\n```\n\n"
                f"![transfer]({out}.png)\n"
            )


def describe_policy(name: str) -> str:
    """What an exported policy is: the rule and its tuned knobs, or the network's family."""
    from autoscale.scalers.policies import find_policy, read_manifest

    m = read_manifest(find_policy(name))
    if m.kind != "parametric":
        return m.family
    knobs = {
        k: (round(v, 3) if isinstance(v, float) else v)
        for k, v in m.parameters.items()
        if k not in ("init_scale", "min_scale", "max_scale")
    }
    return f"{m.family} {knobs}" if knobs else f"{m.family} (its defaults)"


def transfer_name(study: str, policy: str, target: str) -> str:
    """Result file stem of ``policy`` (made for ``study``) evaluated on ``target``."""
    who = study if policy == f"auto-{study}" else policy
    return f"transfer_{who}_to_{Path(target).stem}"


def _annotate(out: str, **fields) -> None:
    path = RESULTS / f"{out}.json"
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_summary() -> None:
    """Build experiments/results/summary.md and the README block from every saved result."""
    summary = [
        "| study | winner (policy) | vs torch on held-out seeds | episodes |",
        "|---|---|---|---|",
    ]
    transfer = [
        "| policy (made for) | evaluated on (never seen) | vs torch | episodes |",
        "|---|---|---|---|",
    ]
    for cfg in load_configs(None):
        path = RESULTS / f"{cfg['name']}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        res["winner"] = describe_policy(res["policy"])
        summary.append(
            f"| [{cfg['name']}](experiments/results/{cfg['name']}.md) | `{res['policy']}`: {res.get('winner', '')} "
            f"| {verdict(res['summaries'], res['policy'])} | {res['episodes']} |"
        )
        for target in cfg.get("transfer_to", []):
            tname = Path(target).stem
            for policy in [res["policy"], *cfg.get("transfer_also", [])]:
                tpath = RESULTS / f"{transfer_name(cfg['name'], policy, target)}.json"
                if tpath.exists():
                    t = json.loads(tpath.read_text())
                    transfer.append(
                        f"| `{policy}` ({cfg['name']}) | [{tname}](experiments/results/{tpath.stem}.md) "
                        f"| {verdict(t['summaries'], policy)} | {t['episodes']} |"
                    )
    body = [
        "Regenerated by `python experiments/reproduce.py` from the results in experiments/results/.",
        "",
        *summary,
        "",
        "Transfer: each policy on workloads it never saw.",
        "",
        *transfer,
    ]
    (RESULTS / "summary.md").write_text("# Results\n\n" + "\n".join(body) + "\n")
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START in text and END in text:
        block = "\n".join([START, "", *body, "", END])
        readme.write_text(text[: text.index(START)] + block + text[text.index(END) + len(END) :])
    print("\n".join(body))


if __name__ == "__main__":
    sys.exit(main())
