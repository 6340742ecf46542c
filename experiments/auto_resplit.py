"""The last auto build's candidates under the suite's three-way split, from its recorded cards.

``experiments/results/auto_selection.json`` holds the real-step scorecards of every candidate of
the last build on every member it evaluated, and the bar per member. That build ranked on the
members the candidates trained on. This script ranks the same cards the way the build does now
(``envs/suite.yaml``: train, validation and test members): by the objective on the validation
members, the bar on every train and validation member, and reads the test members after the
choice, to report. Nothing is run again: the agents are those the build trained on the train
members; a test member the build did not evaluate (a scenario added since) is said to be missing.

    python experiments/auto_resplit.py   # writes experiments/results/auto_resplit.{md,json}
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def main() -> int:
    from autoscale.envs.suite import load_spec
    from autoscale.selection.suite_eval import objective_of
    from autoscale.training.scorecard import Scorecard

    sel = json.loads((RESULTS / "auto_selection.json").read_text())
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    cards = {
        k: {m: [Scorecard.from_dict(c) for c in cs] for m, cs in v.items()}
        for k, v in sel["cards"].items()
    }
    have = set(cards["torch"])
    kinds = {
        "train": [m.name for m in suite.members],
        "validation": [m.name for m in suite.validation],
        "test": [m.name for m in suite.test],
    }
    missing = {k: [m for m in ms if m not in have] for k, ms in kinds.items()}
    measured = {k: [m for m in ms if m in have] for k, ms in kinds.items()}
    objective = {k: objective_of(cards, ms, suite.reward) for k, ms in measured.items()}

    def misses(name: str, members: list[str]) -> list[str]:
        acc = sel["acceptance"][name]
        return [m for m in members if not all(acc[m][x] for x in ("skip", "loss", "precision"))]

    names = [n for n in cards if n != "torch"]
    ranked = sorted(names, key=objective["validation"].get)
    chosen = next(
        (n for n in ranked if not misses(n, measured["train"] + measured["validation"])), None
    )
    rows = []
    for n in ranked:
        rows.append(
            {
                "candidate": n,
                **{k: objective[k][n] for k in kinds},
                "bar_misses": misses(n, measured["train"] + measured["validation"]),
                "test_misses": misses(n, measured["test"]),
            }
        )
    out = {
        "source": "experiments/results/auto_selection.json (the last build's real-step cards)",
        "members": measured,
        "not_measured": missing,
        "ranked_on": "validation",
        "chosen": chosen,
        "validation": objective["validation"],
        "test": objective["test"],
        "train": objective["train"],
        "rows": rows,
    }
    (RESULTS / "auto_resplit.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# The last auto build's candidates under the three-way split",
        "",
        "`python experiments/auto_resplit.py`: the real-step cards of the last build",
        "(`auto_selection.json`), ranked as the build ranks now: by the objective on the validation",
        "members, the bar on every train and validation member, the test members read after the",
        "choice. Objective against `torch` on the same episodes, lower is better. Nothing was run",
        "again: the agents are the build's, trained on the train members.",
        "",
        f"- train: {', '.join(measured['train'])}",
        f"- validation: {', '.join(measured['validation'])}",
        f"- test: {', '.join(measured['test'])}"
        + (
            f" (not measured by that build: {', '.join(missing['test'])})"
            if missing["test"]
            else ""
        ),
        "",
        "| candidate | validation (ranks) | test (reports) | train | misses the bar on |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " **(chosen)**" if r["candidate"] == chosen else ""
        lines.append(
            f"| {r['candidate']}{mark} | {r['validation']:+.4f} | {r['test']:+.4f} | "
            f"{r['train']:+.4f} | {', '.join(r['bar_misses']) or '-'} |"
        )
    best = ranked[0]
    lines += [
        "",
        f"Ranked on validation, `{best}` leads; "
        + (
            f"`{chosen}` is the first that meets the bar on every train and validation member, so it "
            "is what the build would ship from these candidates."
            if chosen
            else "no candidate meets the bar on every train and validation member."
        ),
    ]
    if chosen:
        for r in rows:
            if r["candidate"] == chosen or not r["bar_misses"]:
                continue
            v = objective["validation"][chosen] - r["validation"]
            t = objective["test"][chosen] - r["test"]
            lines.append(
                f"- `{r['candidate']}`: {'ahead of' if v > 0 else 'behind'} `{chosen}` by "
                f"{abs(v):.4f} on validation and {'ahead' if t > 0 else 'behind'} by {abs(t):.4f} "
                f"on test; misses the bar on {', '.join(r['bar_misses'])}"
            )
    (RESULTS / "auto_resplit.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
