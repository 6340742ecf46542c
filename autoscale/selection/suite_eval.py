"""Judging policies on a suite: the ``auto`` build (:mod:`autoscale.selection.auto`) and the suite's
reproduction (experiments/reproduce.py) share it.

* :func:`held_out`: real-step episodes of the *test* instances (never searched or trained on) of
  the chosen members (all by default: train, validation and test members alike), for each
  scaler; the scorecards, the regret against ``torch`` on the same episodes, and the suite
  objective;
* :func:`acceptance`: the bar (:mod:`autoscale.training.bar`) on every member's held-out
  episodes, and :func:`confirm`: more paired episodes of a member where three could not tell a
  difference in eval loss from seed noise;
* :func:`long_runs`: long real runs of a few members (scale trajectories over a whole run, and the
  share of gradient elements kept at fp16 precision), and :func:`long_harm`: where one scaler's
  long run is worse than torch's; both are the long-run harm check the search's no-harm check
  runs too (:mod:`autoscale.training.long_run`: one measure, one judgement);
* :func:`member_limits`: the hindsight limit of each member's held-out steps (a recording of
  the same instances), and :func:`limit_shares`: the share of the achievable precision gain over
  torch that a scaler captures there;
* :func:`save_cards` and :func:`load_cards`: scorecards to JSON and back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.selection.measured import Measured
from autoscale.training import bar
from autoscale.training.long_run import REFERENCE_EVERY as REFERENCE_EVERY
from autoscale.training.long_run import kept_share as kept_share
from autoscale.training.long_run import long_run_harm, measured_run
from autoscale.training.long_run import reference_live as reference_live
from autoscale.training.long_run import structural_share as structural_share


def held_out(
    suite,
    factories: dict[str, Callable[[], Any]],
    steps: int,
    progress: bool = True,
    members: str | list[str] = "all",
    measured: Measured | None = None,
) -> dict[str, dict[str, list]]:
    """Scaler -> member -> scorecards of the member's test instances (real steps), for
    ``members`` (a list of names, or what :class:`~autoscale.envs.suite_env.SuiteEnv` takes);
    episodes ``measured`` holds are read back, the others stored there as they finish."""
    from autoscale.envs.episodes import drive_episode
    from autoscale.envs.suite_env import SuiteEnv
    from autoscale.training.scorecard import Scorecard

    shaped = suite.with_episode_steps(steps)
    env = SuiteEnv(shaped, "test", members=members)
    out: dict[str, dict[str, list]] = {name: {} for name in factories}
    bar = None
    if progress:
        from autoscale.progress import progress_bar

        bar = progress_bar(
            len(factories) * len(env.instance_names), desc="held-out", unit="episode"
        )
    for name, (member, inst) in zip(env.instance_names, env.pairs):
        m = shaped.member(member)
        for scaler, factory in factories.items():
            at = measured.path(scaler, "episode", m.workload, m.episode, inst) if measured else None
            stored = measured.get(at) if measured else None
            if stored is not None:
                card = Scorecard.from_dict(stored)
            else:
                card, _ = drive_episode(env, factory(), name)
                if measured:
                    measured.put(at, card.to_dict())
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


def acceptance(
    cards: dict[str, dict[str, list]], scaler: str, more: dict[str, dict[str, list]] | None = None
) -> dict[str, dict[str, Any]]:
    """Per member: the bar against torch on the same held-out episodes, and whether it is met.

    skip: mean skip rate <= torch's + 0.5 points; precision: lower than torch's where torch loses
    precision on more than 1% of elements; loss: no worse than torch's beyond seed noise. On the
    member's three held-out episodes that is a screen: mean eval loss <= torch's + the spread of
    torch's three (at least 0.2% of torch's mean). Three episodes cannot tell a real difference
    from noise where eval loss scatters widely (heavy-tailed preference losses: the spread of three
    torch episodes itself ranges 0.19-1.0 on gpt2-tiny/preference, experiments/results/
    eval_noise.md), so a member that misses the screen on eval loss alone is measured again on
    more paired episodes (:func:`confirm`; ``more[member]``: scaler -> scorecards of episodes never
    used before). Such a member is judged on all its episodes pooled, and its eval loss by the
    paired difference to torch on the same seeds: worse beyond seed noise when the mean
    difference exceeds ``CONFIRM_Z`` standard errors (and 0.2% of torch's mean).
    """
    out = {}
    for member, mine in cards[scaler].items():
        ref = cards["torch"][member]
        extra = (more or {}).get(member)
        if extra is not None:
            mine, ref = [*mine, *extra[scaler]], [*ref, *extra["torch"]]
        out[member] = bar.acceptance(mine, ref, paired=extra is not None)
    return out


def confirm(
    suite,
    member: str,
    factories: dict[str, Callable[[], Any]],
    episodes: int,
    first_seed: int,
    steps: int,
    measured: Measured | None = None,
) -> dict[str, list]:
    """Scaler -> scorecards of ``episodes`` more real-step episodes of ``member`` at seeds
    ``first_seed``, ``first_seed + 1``, ... (start points cycling over its test instances'), for
    :func:`acceptance`'s ``more``. The caller picks seeds no other stage used."""
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.envs.spec import InstanceSpec

    m = suite.with_episode_steps(steps).member(member)
    starts = [i.start for i in m.instances["test"]]
    test = tuple(
        InstanceSpec(f"confirm{first_seed + k}", first_seed + k, starts[k % len(starts)])
        for k in range(episodes)
    )
    m = dataclasses.replace(m, instances={**m.instances, "test": test})
    if measured is None:
        return evaluate_scalers(m, factories, progress=True)
    from autoscale.training.scorecard import Scorecard

    at = {s: measured.path(s, "confirm", m.workload, m.episode, test) for s in factories}
    out = {}
    for scaler, path in at.items():
        stored = measured.get(path)
        if stored is not None:
            out[scaler] = [Scorecard.from_dict(c) for c in stored]
    todo = {s: f for s, f in factories.items() if s not in out}
    if todo:
        for scaler, cards in evaluate_scalers(m, todo, progress=True).items():
            measured.put(at[scaler], [c.to_dict() for c in cards])
            out[scaler] = cards
    return {s: out[s] for s in factories}


# What a stored long run holds and how it was measured: the measurements' key covers the code that
# runs steps (measured.py), not the counting in training/long_run.py, so a change there bumps this.
LONG_FORMAT = 2


def long_runs(
    suite,
    members: list[str],
    factories: dict[str, Callable[[], Any]],
    steps: int,
    seed: int = 100,
    measured: Measured | None = None,
    reference: bool = True,
) -> dict[str, dict[str, Any]]:
    """Member -> scaler -> one long real run of the member's workload with ``seed``, measured by
    :func:`~autoscale.training.long_run.measured_run` (the search's no-harm check measures its
    runs by the same code): scorecard, step records, ``kept``, ``structural`` and ``nonzero``.
    ``kept`` is, on one applied step in every :data:`REFERENCE_EVERY`, the share of the gradient
    elements an fp32 backward of that step leaves non-zero (:func:`reference_live`) that reach
    the optimizer at fp16 normal precision. ``reference=False`` takes no reference backward
    (``kept`` and ``structural`` are then all NaN): for runs drawn, not judged. Runs ``measured``
    holds are read back, the others stored there."""
    from autoscale.training import TrainingRun

    out: dict[str, dict[str, Any]] = {}
    for name in members:
        out[name] = {}
        workload = suite.member(name).workload.replace(seed=seed)
        for scaler, factory in factories.items():
            how = "reference" if reference else "plain"
            at = (
                measured.path(scaler, "long", workload, steps, how, REFERENCE_EVERY, LONG_FORMAT)
                if measured
                else None
            )
            stored = measured.get(at) if measured else None
            if stored is not None:
                out[name][scaler] = _long_run_from(stored)
                continue
            run = TrainingRun(workload, factory())
            out[name][scaler] = measured_run(run, steps, reference=reference)
            if measured:
                measured.put(at, _long_run_dict(out[name][scaler]))
    return out


def _long_run_dict(run: dict[str, Any]) -> dict[str, Any]:
    records = [r.to_dict() for r in run["records"]]
    return {**run, "card": run["card"].to_dict(), "records": records}


def _long_run_from(d: dict[str, Any]) -> dict[str, Any]:
    from autoscale.training.records import StepRecord
    from autoscale.training.scorecard import Scorecard

    records = [StepRecord.from_dict(r) for r in d["records"]]
    return {**d, "card": Scorecard.from_dict(d["card"]), "records": records}


def zeroed_steps(run: dict[str, Any]) -> int:
    """Applied steps of a :func:`long_runs` run whose gradients the fp16 backward zeroed entirely."""
    return sum(1 for n in run["nonzero"] if n == 0)


def long_harm(
    runs: dict[str, dict[str, Any]], scaler: str, noise: dict[str, float] | None = None
) -> dict[str, list[str]]:
    """Per member of :func:`long_runs`: how ``scaler``'s long run is worse than torch's on the
    same seed (empty: no harm). A policy is used for whole runs, so a rule that wins short
    episodes by what it does early must not lose over a run. Harm is: a divergence torch avoids;
    a skip rate more than torch's + 0.5 points; an eval loss above torch's by more than the
    member's seed noise (``noise[member]``: the spread of torch's eval loss over its held-out
    instances, as in :func:`acceptance`; at least 0.2% of torch's); or a share of gradient
    elements kept at fp16 normal precision (:func:`kept_share`) more than 0.5 points below
    torch's. The last stands for precision: the scorecard's precision loss cannot rank two
    scalers whose fp16 backward zeroes different numbers of elements, and a share of all
    elements cannot rank two runs whose models have different numbers of exact zeros (see
    :func:`~autoscale.training.long_run.measured_run`). The search's no-harm check judges its
    runs by the same :func:`~autoscale.training.long_run.long_run_harm`."""
    return {
        member: long_run_harm(by[scaler], by["torch"], (noise or {}).get(member, 0.0))
        for member, by in runs.items()
    }


def seed_noise(cards: dict[str, dict[str, list]], members: list[str]) -> dict[str, float]:
    """Per member: torch's seed noise over its held-out episodes (:func:`bar.seed_noise`)."""
    return {m: bar.seed_noise([c.eval_loss for c in cards["torch"][m]]) for m in members}


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


def member_limits(suite, members: list[str], steps: int, folder: Path) -> dict[str, float]:
    """Member -> the hindsight limit's precision loss (:mod:`autoscale.envs.limit`) over the first
    ``steps`` steps of its held-out (test) instances, mean over them, from recordings of those
    instances kept in ``folder`` (the same seeds and start points as :func:`held_out`'s
    episodes, so the same batches; the weights follow the recording's own trajectory, so the
    limit is that run's, close to each measured run's but not exactly it)."""
    import hashlib

    from autoscale.envs.limit import hindsight_limit
    from autoscale.envs.traces import Trace, record_trace

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    traces = {}
    for name in members:
        m = suite.member(name)
        key = hashlib.sha256(json.dumps([m.to_dict(), steps], sort_keys=True, default=str).encode())
        path = folder / f"{name.replace('/', '-')}-{steps}-{key.hexdigest()[:12]}.npz"
        try:
            traces[name] = Trace.load(path)
        except Exception:  # not there, or unreadable: record it (again)
            traces[name] = record_trace(m, steps, path, instances=("test",), progress=True)
    out = {}
    for m in (suite.member(name) for name in members):
        trace, ep = traces[m.name], m.episode
        values = [
            hindsight_limit(
                trace.instance(inst.name), trace.hist_edges, 0, steps,
                min_scale=ep.min_scale, max_scale=ep.max_scale,
            ).mean_precision_loss
            for inst in m.instances["test"]
        ]  # fmt: skip
        finite = [v for v in values if math.isfinite(v)]
        out[m.name] = sum(finite) / len(finite) if finite else math.nan
    return out


def limit_shares(
    cards: dict[str, dict[str, list]], limits: dict[str, float], scaler: str
) -> dict[str, float | None]:
    """Member -> the share of the limit ``scaler`` captures on its held-out episodes,
    ``(P_torch - P) / (P_torch - P_limit)`` of the mean precision losses (None: no gain to win)."""
    from autoscale.envs.limit import limit_share

    def mean_p(cs: list) -> float:
        values = [c.precision_loss for c in cs if math.isfinite(c.precision_loss)]
        return sum(values) / len(values) if values else math.nan

    return {
        m: limit_share(mean_p(cards["torch"][m]), mean_p(cs), limits[m])
        for m, cs in cards[scaler].items()
        if m in limits
    }
