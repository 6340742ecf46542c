"""Judging policies on a suite, shared by experiments/reproduce.py and experiments/build_auto.py.

* :func:`held_out`: real-step episodes of every member's *test* instances (never searched or
  trained on), searched and left-out members alike, for each scaler; the scorecards, the regret
  against ``torch`` on the same episodes, and the suite objective;
* :func:`acceptance`: the bar a general policy must clear against ``torch`` on those episodes
  (skip rate at most torch's + 0.5 points, eval loss within seed noise, precision loss lower where
  torch underflows);
* :func:`long_runs`: long real runs of a few members (scale trajectories over a whole run), and
  :func:`long_harm`: where one scaler's long run is worse than torch's;
* markdown tables and plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

SKIP_POINTS = 0.005  # skip rate may exceed torch's by this much (half a percentage point)
UNDERFLOW = 0.01  # torch "underflows" on a member where it loses precision on > 1% of elements


def with_steps(suite, steps: int):
    """``suite`` (left-out members too) with real-step episodes of ``steps`` steps."""

    def shape(m):
        ep = dataclasses.replace(m.episode, steps=steps, horizon=max(steps, m.episode.horizon))
        return dataclasses.replace(m, episode=ep)

    return suite.replace_members(shape)


def held_out(
    suite, factories: dict[str, Callable[[], Any]], steps: int, progress: bool = True
) -> dict[str, dict[str, list]]:
    """Scaler -> member -> scorecards of the member's test instances (real steps)."""
    from autoscale.agents.evaluate import drive_episode
    from autoscale.envs.suite_env import SuiteEnv

    shaped = with_steps(suite, steps)
    env = SuiteEnv(shaped, "test", members="all")
    out: dict[str, dict[str, list]] = {name: {} for name in factories}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(factories) * len(env.instance_names), desc="held-out", unit="episode")
    for name, (member, _) in zip(env.instance_names, env.pairs):
        for scaler, factory in factories.items():
            card, _ = drive_episode(env, factory(), name)
            out[scaler].setdefault(member, []).append(card)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out


def regrets_of(cards: dict[str, dict[str, list]], weights) -> dict[str, dict[str, float]]:
    from autoscale.search.objective import regrets

    return {name: regrets(c, cards["torch"], weights) for name, c in cards.items()}


def objective_of(
    cards: dict[str, dict[str, list]], members: list[str], weights
) -> dict[str, float]:
    """The suite objective over ``members`` against torch."""
    from autoscale.search.objective import objective

    ref = {m: cards["torch"][m] for m in members}
    return {name: objective({m: c[m] for m in members}, ref, weights) for name, c in cards.items()}


def mean(cards: list, field: str) -> float:
    values = [getattr(c, field) for c in cards]
    values = (
        [v if math.isfinite(v) else 1.0 for v in values] if field == "precision_loss" else values
    )
    return math.fsum(values) / len(values)


def acceptance(cards: dict[str, dict[str, list]], scaler: str) -> dict[str, dict[str, Any]]:
    """Per member: the bar against torch on the same held-out episodes, and whether it is met.

    skip: mean skip rate <= torch's + 0.5 points; loss: mean eval loss <= torch's + the spread of
    torch's eval loss over the member's instances (their seed noise; at least 0.2% of it);
    precision: lower than torch's where torch loses precision on more than 1% of elements.
    """
    out = {}
    for member, mine in cards[scaler].items():
        ref = cards["torch"][member]
        evals = [c.eval_loss for c in ref]
        noise = max(max(evals) - min(evals), 0.002 * abs(statistics.mean(evals)))
        skip, skip_ref = mean(mine, "skip_rate"), mean(ref, "skip_rate")
        loss, loss_ref = mean(mine, "eval_loss"), mean(ref, "eval_loss")
        prec, prec_ref = mean(mine, "precision_loss"), mean(ref, "precision_loss")
        row = {
            "skip": skip <= skip_ref + SKIP_POINTS,
            "loss": loss <= loss_ref + noise,
            "precision": prec < prec_ref if prec_ref > UNDERFLOW else True,
            "values": {
                "skip_rate": skip, "torch_skip_rate": skip_ref, "eval_loss": loss,
                "torch_eval_loss": loss_ref, "noise": noise, "precision_loss": prec,
                "torch_precision_loss": prec_ref,
            },
        }  # fmt: skip
        row["met"] = row["skip"] and row["loss"] and row["precision"]
        out[member] = row
    return out


def long_runs(
    suite, members: list[str], factories: dict[str, Callable[[], Any]], steps: int, seed: int = 100
) -> dict[str, dict[str, list]]:
    """Member -> scaler -> scorecard and step records of one long real run (the member's workload,
    ``seed``)."""
    from autoscale.training import TrainingRun

    out: dict[str, dict[str, Any]] = {}
    for name in members:
        member = suite.member(name)
        out[name] = {}
        for scaler, factory in factories.items():
            run = TrainingRun(member.workload.replace(seed=seed), factory())
            card = run.run(steps)
            out[name][scaler] = {"card": card, "records": list(run.records)}
    return out


def long_harm(runs: dict[str, dict[str, Any]], scaler: str) -> dict[str, list[str]]:
    """Per member of :func:`long_runs`: how ``scaler``'s long run is worse than torch's on the
    same seed (empty: no harm). A policy is used for whole runs, so a rule that wins short
    episodes by what it does early must not lose over a run: more than torch's skip rate + 0.5
    points, a precision loss more than 0.5 points above torch's, or a divergence torch avoids."""
    out = {}
    for member, by in runs.items():
        mine, ref = by[scaler]["card"], by["torch"]["card"]
        why = []
        if mine.diverged and not ref.diverged:
            why.append("diverged")
        if mine.skip_rate > ref.skip_rate + SKIP_POINTS:
            why.append(f"skips {100 * mine.skip_rate:.2f}% vs torch {100 * ref.skip_rate:.2f}%")
        prec, prec_ref = mine.precision_loss, ref.precision_loss
        if not math.isfinite(prec) or (math.isfinite(prec_ref) and prec > prec_ref + SKIP_POINTS):
            why.append(f"precision loss {100 * prec:.2f}% vs torch {100 * prec_ref:.2f}%")
        out[member] = why
    return out


def plot_long_runs(runs: dict[str, dict[str, list]], path: Path, title: str) -> None:
    """One panel per member: log2 scale per step of each scaler; x marks skipped steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.8 * len(runs)), constrained_layout=True)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (member, by_scaler) in zip(axes, runs.items()):
        for i, (scaler, run) in enumerate(by_scaler.items()):
            records = run["records"]
            xs = [r.step for r in records]
            ys = [math.log2(r.scale) for r in records]
            skipped = sum(r.found_inf for r in records)
            ax.plot(xs, ys, color=f"C{i}", lw=1.2, label=f"{scaler} ({skipped} skipped)")
            sx = [r.step for r in records if r.found_inf]
            sy = [math.log2(r.scale) for r in records if r.found_inf]
            ax.scatter(sx, sy, color=f"C{i}", marker="x", s=12)
        ax.set_title(member, fontsize=10, loc="left")
        ax.set_ylabel("log2 scale")
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.savefig(path, dpi=90)


def table(cards, members: list[str], left_out: set[str], weights, scalers: list[str]) -> list[str]:
    """Markdown: per member and scaler, skip rate, precision loss, eval loss and regret."""
    regrets = regrets_of(cards, weights)
    lines = [
        "| member | scaler | skip rate | precision loss | eval loss | regret vs torch |",
        "|---|---|---|---|---|---|",
    ]
    for m in members:
        tag = " (left out)" if m in left_out else ""
        for s in scalers:
            c = cards[s][m]
            lines.append(
                f"| {m}{tag} | {s} | {100 * mean(c, 'skip_rate'):.2f}% | "
                f"{100 * mean(c, 'precision_loss'):.3f}% | {mean(c, 'eval_loss'):.4g} | "
                f"{regrets[s][m]:+.4f} |"
            )
    return lines


def save_cards(cards: dict[str, dict[str, list]], path: Path, **extra: Any) -> None:
    from autoscale.training.scorecard import json_safe

    data = {s: {m: [c.to_dict() for c in cs] for m, cs in by.items()} for s, by in cards.items()}
    path.write_text(json.dumps(json_safe({"cards": data, **extra}), indent=1) + "\n")


def load_cards(path: Path) -> tuple[dict[str, dict[str, list]], dict[str, Any]]:
    from autoscale.training.scorecard import Scorecard

    data = json.loads(path.read_text())
    cards = {
        s: {m: [Scorecard.from_dict(c) for c in cs] for m, cs in by.items()}
        for s, by in data.pop("cards").items()
    }
    return cards, data


def write_readme_block(readme: Path, start: str, end: str, block: list[str]) -> bool:
    """Replace what stands between the ``start`` and ``end`` markers of ``readme`` with ``block``;
    False (and nothing written) when the markers are missing."""
    text = readme.read_text()
    if start not in text or end not in text:
        return False
    body = "\n".join([start, "", *block, "", end])
    readme.write_text(text[: text.index(start)] + body + text[text.index(end) + len(end) :])
    return True
