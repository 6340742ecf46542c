"""The build of the general policy ``auto``: what ships, decided in one place.

1. Record long traces of the train instances of every searched member of the suite.
2. Train RL agents on their replay (:mod:`autoscale.build.agents`).
3. Candidates: those agents, the suite search's pick when there is one, the built-in
   ``amax-history`` and any parametric ``extras``; ``torch`` is the reference. Each runs real steps
   of every member's *test* instances (left-out members too); the objective against torch on the
   searched members ranks them.
4. :func:`choose`: in the objective's order, the first candidate that meets the bar on every member
   (:mod:`autoscale.training.bar`, with paired confirmation of a member missed on eval loss alone),
   passes the search's no-harm check and does no harm in long runs of every member is measured
   again on fresh seeds (never used for training or selection), and ships only if it meets the bar
   there too.
5. :meth:`AutoBuild.export`: the pick as ``<dest>/auto``, its evidence in the manifest.

``experiments/build_auto.py`` drives it and writes the reports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autoscale.build import suite_eval as ev
from autoscale.training.bar import first_passing

EVIDENCE_SEED_OFFSET = 1000  # fresh seeds: the test seeds + 1000
# first seeds of the confirming episodes at selection and on fresh seeds: apart from the train
# (0-2), test (100-102) and fresh (1100-1102) seeds, and from the seeds experiments/eval_noise.py
# has looked at (2000-2011)
CONFIRM_SEEDS = {"selection": 5000, "evidence": 6000}
LONG_RUN_SEED = 100
REFERENCE = "amax-history"  # the built-in rule every build ranks and reports beside its pick


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    """How much the build measures: agent training (``timesteps`` of ``horizon``-step replay
    episodes, ``history`` stacked vectors), real steps per held-out episode (``steps``), the
    no-harm check's (``gate_steps``), the long runs' (``long_steps``, 0: none), and the paired
    episodes more of a member missed on eval loss alone (``confirm_episodes``, 0: none); with
    ``scale_time``, each agent also trained to act when the loss is scaled, seeing it."""

    timesteps: int = 300_000
    horizon: int = 512
    history: int = 4
    steps: int = 256
    seed: int = 0
    gate_steps: int = 1000
    long_steps: int = 2000
    confirm_episodes: int = 12
    reuse_agents: bool = False
    scale_time: bool = True  # also train each agent acting at scale time (``rl-...-now``)


def parse_extra(text: str) -> tuple[str, tuple[str, dict[str, float | int]]]:
    """``RULE:key=value,...`` -> (its label, (rule, parameters)): a parametric candidate.
    Raises ValueError naming the value that is not a number."""
    rule, _, rest = text.partition(":")
    params: dict[str, float | int] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            params[key.strip()] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            raise ValueError(f"{text!r}: {key}={value!r} is not a number") from None
    label = f"{rule}({', '.join(f'{k}={v}' for k, v in params.items())})" if params else rule
    return label, (rule, params)


def choose(
    ranked: Sequence[str],
    checks: Sequence[Callable[[str], list[str]]],
    on_fresh_seeds: Callable[[str], list[str]],
) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """What ships: the first of ``ranked`` that every check passes (each returns the reasons it
    fails, empty when it passes; a candidate failing one is passed over, a harm gate, not a
    contest), and only if ``on_fresh_seeds`` then finds no miss. Fresh seeds are spent once: a
    pick that misses there ships nothing, rather than trying the next candidate on seeds already
    seen. Returns the pick (None: nothing ships) and, per candidate reached, whether it passed and
    why not."""
    pick, why = first_passing(list(ranked), list(checks))
    verdicts = {s: {"passed": not r, "reasons": list(r)} for s, r in why.items()}
    if pick is not None:
        misses = on_fresh_seeds(pick)
        if misses:
            verdicts[pick] = {"passed": False, "reasons": [*verdicts[pick]["reasons"], *misses]}
            pick = None
    return pick, verdicts


def fresh_seeds(suite):
    """The suite with every member's test instances moved to fresh seeds (test seed + 1000)."""
    from autoscale.envs.spec import InstanceSpec

    def shape(m):
        test = tuple(
            InstanceSpec(f"{i.name}+fresh", i.seed + EVIDENCE_SEED_OFFSET, i.start)
            for i in m.instances["test"]
        )
        return dataclasses.replace(m, instances={**m.instances, "test": test})

    return suite.replace_members(shape)


@dataclasses.dataclass
class LongRuns:
    """One candidate's long runs of every member next to torch's, and the harm found per member."""

    runs: dict[str, dict[str, Any]]
    harm: dict[str, list[str]]


@dataclasses.dataclass
class BuildResult:
    """Everything a build measured and decided, for its reports."""

    settings: BuildSettings
    searched: list[str]
    left_out: list[str]
    weights: Any
    candidates: list[str]  # in the order they ran, torch last
    agent_runs: dict[str, dict]
    same_as_builtin: str | None  # the built-in rule the suite search exported as itself
    cards: dict[str, dict[str, list]]  # the selection: scaler -> member -> scorecards
    objective: dict[str, float]
    zero_shot: dict[str, float]
    acceptance: dict[str, dict[str, dict]]
    confirmed: dict[str, dict[str, dict[str, list]]]  # scaler -> member -> more episodes
    ranked: list[str]
    verdicts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    long_runs: dict[str, LongRuns] = dataclasses.field(default_factory=dict)
    evidence: dict[str, dict[str, list]] | None = None  # fresh seeds: pick, REFERENCE, torch
    evidence_acceptance: dict[str, dict] | None = None
    evidence_confirmed: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)
    pick: str | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def long_summary(self, scaler: str) -> dict[str, dict]:
        """Member -> {scaler, torch} -> skip rate, eval loss, precision loss, kept, zeroed steps of
        ``scaler``'s long runs (empty when it had none)."""
        long = self.long_runs.get(scaler)
        if long is None:
            return {}
        return {
            m: {
                who: {
                    "skip_rate": run[who]["card"].skip_rate,
                    "eval_loss": run[who]["card"].eval_loss,
                    "precision_loss": run[who]["card"].precision_loss,
                    "kept": ev.kept_share(run[who]),
                    "zeroed_steps": ev.zeroed_steps(run[who]),
                }
                for who in (scaler, "torch")
            }
            for m, run in long.runs.items()
        }


class AutoBuild:
    """One build of ``auto`` over ``suite``: agents and traces cached under ``cache``, torch's runs
    of the no-harm check under ``no_harm_cache`` (default ``cache/no-harm``); ``searched_pick`` is
    the suite search's exported policy, ranked when it exists; ``extras`` are labelled parametric
    candidates (:func:`parse_extra`)."""

    def __init__(
        self,
        suite,
        settings: BuildSettings,
        cache: Path,
        *,
        searched_pick: Path | None = None,
        no_harm_cache: Path | None = None,
        extras: dict[str, tuple[str, dict]] | None = None,
        log: Callable[[str], Any] = print,
    ):
        from autoscale.envs.episodes import scaler_for

        self.suite, self.settings, self.cache = suite, settings, Path(cache)
        self.searched_pick, self.extras, self.log = searched_pick, dict(extras or {}), log
        self.no_harm_cache = Path(no_harm_cache) if no_harm_cache else self.cache / "no-harm"
        self.member = suite.members[0]
        for label, (rule, params) in self.extras.items():  # a bad one says so now, not in hours
            try:
                scaler_for(rule, self.member, **params)
            except Exception as exc:
                raise ValueError(f"{label}: {exc}") from exc
        self.factories: dict[str, Callable[[], Any]] = {}
        self.agents: dict[str, Path] = {}
        self._check = None  # the no-harm check, built at its first use

    def run(self) -> BuildResult:
        """Record, train, select, choose; the pick is exported by :meth:`export`."""
        s, t_all = self.settings, time.monotonic()
        timings: dict[str, float] = {}
        self.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        traces = self.record()
        timings["record"] = time.monotonic() - t0
        from autoscale.build.agents import train_agents

        self.agents, agent_runs = train_agents(
            self.suite, traces, s, self.cache / "policies", timings, self.log
        )
        same_as_builtin = self._candidates()
        t0 = time.monotonic()
        cards = ev.held_out(self.suite, self.factories, s.steps)
        timings["select"] = time.monotonic() - t0
        searched = [m.name for m in self.suite.members]
        left = [m.name for m in self.suite.left_out]
        weights = self.suite.reward
        names = [n for n in self.factories if n != "torch"]
        objective = ev.objective_of(cards, searched, weights)
        result = BuildResult(
            settings=s,
            searched=searched,
            left_out=left,
            weights=weights,
            candidates=list(self.factories),
            agent_runs=agent_runs,
            same_as_builtin=same_as_builtin,
            cards=cards,
            objective=objective,
            zero_shot=ev.objective_of(cards, left, weights),
            acceptance={n: ev.acceptance(cards, n) for n in names},
            confirmed={},
            ranked=sorted(names, key=lambda n: objective[n]),
            timings=timings,
        )
        self.log("objective (searched members): "
                  + ", ".join(f"{n} {objective[n]:+.4f}" for n in result.ranked))  # fmt: skip
        timings["no-harm"] = timings["long runs"] = 0.0
        checks = [
            lambda n: self._meets_the_bar(result, n),
            lambda n: self._passes_the_check(result, n),
            lambda n: self._no_harm_in_long_runs(result, n),
        ]
        result.pick, result.verdicts = choose(
            result.ranked, checks, lambda n: self._on_fresh_seeds(result, n)
        )
        timings["total"] = time.monotonic() - t_all
        return result

    def record(self):
        """Traces of every train instance, twice the horizon long (early and late in the run)."""
        from autoscale.build.agents import rl_suite
        from autoscale.search.traces import load_traces

        h = self.settings.horizon
        traces, stats = load_traces(
            rl_suite(self.suite, h, 1), self.cache, 2 * h, cost=lambda m, n: 0.0,
            stop_at=math.inf, progress=True,
        )  # fmt: skip
        self.log(f"traces: {stats['recorded']} recorded, {stats['cached']} cached")
        return traces

    def _candidates(self) -> str | None:
        """Fill ``self.factories``; returns the built-in rule the suite search exported as itself."""
        from autoscale.envs.episodes import scaler_for
        from autoscale.scalers.policies import read_manifest

        member, f = self.member, self.factories
        f.update({n: (lambda p=p: scaler_for(str(p), member)) for n, p in self.agents.items()})
        same_as_builtin = None
        pick = self.searched_pick
        if pick is not None and (pick / "policy.yaml").is_file():
            same_as_builtin = read_manifest(pick).workload.get("builtin_rule")
            if same_as_builtin is None:
                f["suite-parametric"] = lambda: scaler_for(str(pick), member)
            else:
                if same_as_builtin != REFERENCE:
                    f[same_as_builtin] = lambda r=same_as_builtin: scaler_for(r, member)
                self.log(f"the suite search's pick is the built-in {same_as_builtin} with its "
                          "defaults: ranked as that rule")  # fmt: skip
        f[REFERENCE] = lambda: scaler_for(REFERENCE, member)
        for label, (rule, params) in self.extras.items():
            f[label] = lambda r=rule, kw=params: scaler_for(r, member, **kw)
        f["torch"] = lambda: scaler_for("torch", member)
        return same_as_builtin

    def _confirm_loss(self, suite, cards, scaler: str, first_seed: int):
        """``scaler``'s acceptance on ``cards``, members missed on eval loss alone judged again on
        ``confirm_episodes`` more paired episodes (seeds from ``first_seed``), and those episodes."""
        from autoscale.training.bar import missed_on_loss_alone

        accept = ev.acceptance(cards, scaler)
        todo = [m for m, r in accept.items() if missed_on_loss_alone(r)]
        n = self.settings.confirm_episodes
        if not todo or n <= 0:
            return accept, {}
        pair = {scaler: self.factories[scaler], "torch": self.factories["torch"]}
        more = {}
        for m in todo:
            self.log(f"{scaler}: eval loss on {m} not told from seed noise by three episodes: "
                      f"{n} paired episodes more")  # fmt: skip
            more[m] = ev.confirm(suite, m, pair, n, first_seed, self.settings.steps)
        return ev.acceptance(cards, scaler, more), more

    def _meets_the_bar(self, r: BuildResult, name: str) -> list[str]:
        r.acceptance[name], r.confirmed[name] = self._confirm_loss(
            self.suite, r.cards, name, CONFIRM_SEEDS["selection"]
        )
        misses = [m for m, a in r.acceptance[name].items() if not a["met"]]
        if misses:
            self.log(f"{name}: misses the bar on {', '.join(misses)}")
            return [f"misses the bar on {', '.join(misses)}"]
        return []

    def _passes_the_check(self, r: BuildResult, name: str) -> list[str]:
        from autoscale.search.budget import Ledger
        from autoscale.search.gate import NoHarmCheck, gate_workloads
        from autoscale.search.timing import GatePlan

        if self._check is None:
            s, ep = self.settings, self.member.episode
            gate = GatePlan(gate_workloads(list(self.suite.members), s.gate_steps), s.gate_steps)
            self._check = NoHarmCheck(
                gate, self.no_harm_cache, Ledger(),
                {"init_scale": ep.init_scale, "min_scale": ep.min_scale, "max_scale": ep.max_scale},
            )  # fmt: skip
        t0 = time.monotonic()
        verdict = self._check.check(self.factories[name], name)
        r.timings["no-harm"] += time.monotonic() - t0
        self.log(verdict.summary())
        return list(verdict.reasons)

    def _no_harm_in_long_runs(self, r: BuildResult, name: str) -> list[str]:
        if self.settings.long_steps <= 0:
            return []
        members = r.searched + r.left_out
        pair = {name: self.factories[name], "torch": self.factories["torch"]}
        t0 = time.monotonic()
        runs = ev.long_runs(self.suite, members, pair, self.settings.long_steps, LONG_RUN_SEED)
        r.timings["long runs"] += time.monotonic() - t0
        harm = ev.long_harm(runs, name, ev.seed_noise(r.cards, members))
        r.long_runs[name] = LongRuns(runs, harm)
        harmed = [m for m in members if harm[m]]
        if harmed:
            reason = f"long runs: worse than torch on {', '.join(harmed)}"
            self.log(f"{name}: {reason}")
            return [reason]
        return []

    def _on_fresh_seeds(self, r: BuildResult, pick: str) -> list[str]:
        """The evidence: three episodes a member are few, so a pick that met the bar on them by
        chance must meet it again on fresh seeds (test seeds + 1000) to ship."""
        t0 = time.monotonic()
        fresh = fresh_seeds(self.suite)
        keep = dict.fromkeys((pick, REFERENCE, "torch"))
        r.evidence = ev.held_out(fresh, {k: self.factories[k] for k in keep}, self.settings.steps)
        r.evidence_acceptance, r.evidence_confirmed = self._confirm_loss(
            fresh, r.evidence, pick, CONFIRM_SEEDS["evidence"]
        )
        r.timings["evidence"] = time.monotonic() - t0
        misses = [m for m, a in r.evidence_acceptance.items() if not a["met"]]
        if misses:
            reason = f"on fresh seeds misses the bar on {', '.join(misses)}"
            self.log(f"{pick}: {reason}")
            return [reason]
        return []

    def export(self, r: BuildResult, dest_root: Path, built_by: str):
        """Write ``r.pick`` as ``dest_root/auto`` (an extra rule with its parameters, an agent's or
        the suite search's folder renamed, or a built-in rule with its defaults; the episode's
        scale bounds with it), its selection, evidence, no-harm verdict and long runs in the
        manifest; check that it loads. Returns the manifest."""
        from autoscale.scalers import get_scaler
        from autoscale.scalers.policies import read_manifest, staged_policy, write_manifest
        from autoscale.search.export import export_parametric
        from autoscale.search.objective import OBJECTIVE_DOC
        from autoscale.search.trials import member_summary

        if r.pick is None or r.evidence is None or r.evidence_acceptance is None:
            raise ValueError("nothing to export: no candidate passed")
        pick, ep = r.pick, self.member.episode
        bounds = {"init_scale": ep.init_scale, "min_scale": ep.min_scale, "max_scale": ep.max_scale}
        source = self.agents.get(pick) or (
            self.searched_pick if pick == "suite-parametric" else None
        )
        if pick in self.extras:
            rule, params = self.extras[pick]
            export_parametric(rule, {**bounds, **params}, "auto", out_dir=dest_root, force=True)
        elif source is not None:
            manifest = read_manifest(source)
            with staged_policy("auto", dest_root, force=True) as tmp:
                for f in Path(source).iterdir():
                    if not f.name.startswith("."):
                        (tmp / f.name).write_bytes(f.read_bytes())
                write_manifest(tmp, dataclasses.replace(manifest, name="auto"))
        else:  # a built-in rule
            export_parametric(pick, bounds, "auto", out_dir=dest_root, force=True)
        ev_obj = ev.objective_of(r.evidence, r.searched, r.weights)
        ev_zero = ev.objective_of(r.evidence, r.left_out, r.weights)
        scorecard = {
            "objective": OBJECTIVE_DOC,
            "selection": {
                "instances": "test instances (seeds 100-102) of every member",
                "steps": r.settings.steps,
                "objective_searched": r.objective,
                "objective_left_out": r.zero_shot,
            },
            "evidence": {
                "instances": "fresh seeds (test seeds + 1000), never used for training or selection",
                "steps": r.settings.steps,
                "objective_searched": ev_obj[pick],
                "objective_left_out": ev_zero[pick],
                "members": member_summary(r.evidence[pick], r.evidence["torch"], r.weights),
                "bar_met_on": [m for m, a in r.evidence_acceptance.items() if a["met"]],
                "bar_missed_on": [m for m, a in r.evidence_acceptance.items() if not a["met"]],
            },
            "no_harm": r.verdicts[pick],
            "long_runs": {
                "steps": r.settings.long_steps,
                "seed": LONG_RUN_SEED,
                "members": r.long_summary(pick),
            },
        }
        manifest = read_manifest(dest_root / "auto")
        workload = {
            **manifest.workload,
            "suite": self.suite.name,
            "members": r.searched,
            "left_out": r.left_out,
            "built_by": built_by,
        }
        manifest = dataclasses.replace(
            manifest, workload=workload, scorecard=json.loads(json.dumps(scorecard, default=float))
        )
        write_manifest(dest_root / "auto", manifest)
        get_scaler(str(dest_root / "auto"), device="cpu")  # it loads
        return manifest
