"""The build of the general policy ``auto``: what ships, decided in one place.

The suite's members come in three kinds (:class:`~autoscale.envs.suite.SuiteSpec`): *train*
members (the search and the agents learn there), *validation* members (the build chooses there)
and *test* members (read once, after the choice, to report). A user runs ``auto`` on a workload
no suite has, so the choice is made on members no candidate trained on; and the members that
report it must be members nothing chose on, or they stop measuring.

1. Record long traces of the train instances of every train member of the suite.
2. Train RL agents on their replay (:mod:`autoscale.selection.agents`).
3. Candidates: those agents, the suite search's pick when there is one, the built-in
   ``amax-history`` and any parametric ``extras``; ``torch`` is the reference. Each runs real steps
   of the *test* instances of every train and validation member; the objective against torch on
   the validation members ranks them (on the train members where a suite has no validation one).
4. :func:`what_ships`: in that order, the first candidate that meets the bar on every train and
   validation member (:mod:`autoscale.training.bar`, with paired confirmation of a member missed
   on eval loss alone), passes the search's no-harm check and does no harm in long runs of those
   members is measured again on fresh seeds (never used for training or selection), and is the
   choice only if it meets the bar there too.
5. Only then the test members: every candidate runs their test instances (the test objective,
   reported); the choice is judged there by the same bar and long runs, and ships only if it does
   no harm there either. A choice that harms a test member ships nothing: the next candidate is
   not tried, since test members that picked it would no longer measure it.
6. :meth:`AutoBuild.export`: what ships as ``<dest>/auto``, its evidence in the manifest.

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

from autoscale.selection import suite_eval as ev
from autoscale.selection.result import BuildResult, LongRuns
from autoscale.training.bar import first_passing

EVIDENCE_SEED_OFFSET = 1000  # fresh seeds: the test seeds + 1000
# first seeds of the confirming episodes at selection and on fresh seeds: apart from the train
# (0-2), test (100-102) and fresh (1100-1102) seeds, and from the seeds experiments/eval_noise.py
# has looked at (2000-2011)
CONFIRM_SEEDS = {"selection": 5000, "evidence": 6000, "test": 7000}
LONG_RUN_SEED = 100
REFERENCE = "amax-history"  # the built-in rule every build ranks and reports beside its pick


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    """How much the build measures: agent training (``timesteps`` of ``horizon``-step replay
    episodes, ``history`` stacked vectors), real steps per held-out episode (``steps``), the
    no-harm check's (``no_harm_steps``), the long runs' (``long_steps``, 0: none), and the paired
    episodes more of a member missed on eval loss alone (``confirm_episodes``, 0: none); with
    ``scale_time``, each agent also trained to act when the loss is scaled, seeing it; with
    ``knobs``, every agent trained under scenario knobs drawn per replayed episode."""

    timesteps: int = 300_000
    horizon: int = 512
    history: int = 4
    steps: int = 256
    seed: int = 0
    no_harm_steps: int = 1000
    long_steps: int = 2000
    confirm_episodes: int = 12
    reuse_agents: bool = False
    scale_time: bool = True  # also train each agent acting at scale time (``rl-...-now``)
    knobs: bool = False  # train the agents under scenario knobs drawn per episode (``-knobs``)
    residual: bool = True  # also train residual agents on auto (``rl-res-...``)
    residual_timesteps: int = 20_000  # their decisions
    window: int = 16  # steps a residual agent's offset holds
    residual_knobs: bool = True  # train the residual agents under scenario knobs (``-knobs``)


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


def what_ships(
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
    """The suite with every member's test instances moved to fresh seeds (test seed + 1000); the
    build measures its choice there on the train and validation members."""
    from autoscale.envs.spec import InstanceSpec

    def shape(m):
        test = tuple(
            InstanceSpec(f"{i.name}+fresh", i.seed + EVIDENCE_SEED_OFFSET, i.start)
            for i in m.instances["test"]
        )
        return dataclasses.replace(m, instances={**m.instances, "test": test})

    return suite.replace_members(shape)


class AutoBuild:
    """One build of ``auto`` over ``suite``: agents and traces cached under ``cache``, torch's runs
    of the no-harm check under ``no_harm_cache`` (default ``cache/no-harm``); ``searched_pick`` is
    the suite search's exported policy, ranked when it exists; ``extras`` are labelled parametric
    candidates (:func:`parse_extra`). With ``keep_measured`` every held-out episode, confirming
    set and long run is kept under ``cache/measured`` as it finishes and read back by a build
    run again (:mod:`autoscale.selection.measured`): a stopped build resumes there."""

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
        keep_measured: bool = True,
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
        self.identities: dict[str, str] = {}  # what each candidate is, for ``self.measured``
        self.measured: Any = None  # the real-step measurements kept on disk (measured.py)
        self.keep_measured = keep_measured
        self.agents: dict[str, Path] = {}
        self._check = None  # the no-harm check, built at its first use

    def run(self) -> BuildResult:
        """Record, train, select, choose, then read the test members; the pick is exported by
        :meth:`export`."""
        s, t_all = self.settings, time.monotonic()
        timings: dict[str, float] = {}
        self.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        traces = self.record()
        timings["record"] = time.monotonic() - t0
        from autoscale.selection.agents import train_agents

        self.agents, agent_runs = train_agents(
            self.suite, traces, s, self.cache / "policies", timings, self.log
        )
        same_as_builtin = self._candidates()
        from autoscale.selection.measured import Measured

        if self.keep_measured:
            self.measured = Measured(self.cache / "measured", self.identities)
        searched = [m.name for m in self.suite.members]
        validation = [m.name for m in self.suite.validation]
        test = [m.name for m in self.suite.test]
        t0 = time.monotonic()
        cards = ev.held_out(
            self.suite, self.factories, s.steps, members=searched + validation,
            measured=self.measured,
        )  # fmt: skip
        timings["select"] = time.monotonic() - t0
        weights = self.suite.reward
        names = [n for n in self.factories if n != "torch"]
        objective = ev.objective_of(cards, searched, weights)
        on_validation = ev.objective_of(cards, validation, weights) if validation else {}
        rank_by = on_validation or objective
        result = BuildResult(
            settings=s,
            searched=searched,
            left_out=[m.name for m in self.suite.left_out],
            weights=weights,
            candidates=list(self.factories),
            agent_runs=agent_runs,
            same_as_builtin=same_as_builtin,
            cards=cards,
            objective=objective,
            zero_shot=ev.objective_of(cards, validation, weights) if validation else {},
            acceptance={n: ev.acceptance(cards, n) for n in names},
            confirmed={},
            ranked=sorted(names, key=lambda n: rank_by[n]),
            validation=validation,
            test=test,
            objective_validation=on_validation,
            ranked_on="validation" if validation else "train",
            timings=timings,
        )
        self.log(f"objective ({result.ranked_on} members, ranks): "
                  + ", ".join(f"{n} {rank_by[n]:+.4f}" for n in result.ranked))  # fmt: skip
        timings["no-harm"] = timings["long runs"] = 0.0
        checks = [
            lambda n: self._meets_the_bar(result, n),
            lambda n: self._passes_the_check(result, n),
            lambda n: self._no_harm_in_long_runs(result, n),
        ]
        result.chosen, result.verdicts = what_ships(
            result.ranked, checks, lambda n: self._on_fresh_seeds(result, n)
        )
        result.pick = result.chosen
        self._on_test_members(result)  # the choice is fixed: now, and only now, the test members
        t0 = time.monotonic()  # how close each candidate came to the best any could do
        result.limits = ev.member_limits(self.suite, searched + validation + test, s.steps,
                                         self.cache / "limit")  # fmt: skip
        result.limit_shares = {n: ev.limit_shares(result.cards, result.limits, n) for n in names}
        timings["limits"] = time.monotonic() - t0
        timings["total"] = time.monotonic() - t_all
        return result

    def record(self):
        """Traces of every train instance, twice the horizon long (early and late in the run)."""
        from autoscale.search.traces import load_traces
        from autoscale.selection.agents import rl_suite

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
        from autoscale.selection.measured import files_hash

        member, f, ids = self.member, self.factories, self.identities
        f.update({n: (lambda p=p: scaler_for(str(p), member)) for n, p in self.agents.items()})
        ids.update({n: f"policy {files_hash([p])}" for n, p in self.agents.items()})
        same_as_builtin = None
        pick = self.searched_pick
        if pick is not None and (pick / "policy.yaml").is_file():
            same_as_builtin = read_manifest(pick).workload.get("builtin_rule")
            if same_as_builtin is None:
                f["suite-parametric"] = lambda: scaler_for(str(pick), member)
                ids["suite-parametric"] = f"policy {files_hash([pick])}"
            else:
                if same_as_builtin != REFERENCE:
                    f[same_as_builtin] = lambda r=same_as_builtin: scaler_for(r, member)
                    ids[same_as_builtin] = f"rule {same_as_builtin} {{}}"
                self.log(f"the suite search's pick is the built-in {same_as_builtin} with its "
                          "defaults: ranked as that rule")  # fmt: skip
        f[REFERENCE] = lambda: scaler_for(REFERENCE, member)
        for label, (rule, params) in self.extras.items():
            f[label] = lambda r=rule, kw=params: scaler_for(r, member, **kw)
            ids[label] = f"rule {rule} {sorted(params.items())}"
        f["torch"] = lambda: scaler_for("torch", member)
        ids.update({n: f"rule {n} {{}}" for n in (REFERENCE, "torch")})
        bounds = member.episode
        for n in ids:  # every candidate is built with the episode's scale bounds
            ids[n] += f" {bounds.init_scale} {bounds.min_scale} {bounds.max_scale}"
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
            more[m] = ev.confirm(
                suite, m, pair, n, first_seed, self.settings.steps, measured=self.measured
            )
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
        from autoscale.search.no_harm import NoHarmCheck, no_harm_workloads
        from autoscale.search.timing import NoHarmPlan

        if self._check is None:
            s, ep = self.settings, self.member.episode
            no_harm = NoHarmPlan(
                no_harm_workloads(list(self.suite.members), s.no_harm_steps), s.no_harm_steps
            )
            self._check = NoHarmCheck(no_harm, self.no_harm_cache, Ledger(), ep.scale_kwargs())
        t0 = time.monotonic()
        verdict = self._check.check(self.factories[name], name)
        r.timings["no-harm"] += time.monotonic() - t0
        self.log(verdict.summary())
        return list(verdict.reasons)

    def _no_harm_in_long_runs(
        self, r: BuildResult, name: str, members: list[str] | None = None
    ) -> list[str]:
        """Long runs of ``members`` (default: the train and validation ones), kept in
        ``r.long_runs`` beside any earlier ones of ``name``; the reason when one is harmed."""
        if self.settings.long_steps <= 0:
            return []
        members = r.chosen_on if members is None else members
        pair = {name: self.factories[name], "torch": self.factories["torch"]}
        t0 = time.monotonic()
        runs = ev.long_runs(
            self.suite, members, pair, self.settings.long_steps, LONG_RUN_SEED, self.measured
        )
        r.timings["long runs"] += time.monotonic() - t0
        harm = ev.long_harm(runs, name, ev.seed_noise(r.cards, members))
        before = r.long_runs.get(name, LongRuns({}, {}))
        r.long_runs[name] = LongRuns({**before.runs, **runs}, {**before.harm, **harm})
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
        r.evidence = ev.held_out(
            fresh, {k: self.factories[k] for k in keep}, self.settings.steps, members=r.chosen_on,
            measured=self.measured,
        )  # fmt: skip
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

    def _on_test_members(self, r: BuildResult) -> None:
        """After the choice: every candidate on the test members' test instances (the test
        objective, reported beside the others), and the choice judged there by the bar and long
        runs. A choice that harms a test member ships nothing (``r.pick`` None, the reason in its
        verdict); nothing here changes which candidate was chosen."""
        if not r.test:
            return
        t0 = time.monotonic()
        cards = ev.held_out(
            self.suite, self.factories, self.settings.steps, members=r.test, measured=self.measured
        )
        r.timings["test"] = time.monotonic() - t0
        for scaler, by in cards.items():
            r.cards[scaler].update(by)
        r.objective_test = ev.objective_of(cards, r.test, r.weights)
        r.zero_shot = ev.objective_of(r.cards, r.left_out, r.weights)
        for name in r.acceptance:
            if name != r.chosen:  # a screen only, reported: nothing was chosen on it
                r.acceptance[name].update(ev.acceptance(cards, name))
        self.log("objective (test members, after the choice): "
                  + ", ".join(f"{n} {r.objective_test[n]:+.4f}" for n in r.ranked))  # fmt: skip
        if r.chosen is None:
            return
        accept, r.test_confirmed = self._confirm_loss(
            self.suite, cards, r.chosen, CONFIRM_SEEDS["test"]
        )
        r.acceptance[r.chosen].update(accept)
        reasons = [
            f"on test members misses the bar on {m}" for m, a in accept.items() if not a["met"]
        ]
        reasons += [
            f"on test members: {why}" for why in self._no_harm_in_long_runs(r, r.chosen, r.test)
        ]
        if reasons:
            self.log(f"{r.chosen}: chosen, but {'; '.join(reasons)}: nothing ships")
            verdict = r.verdicts[r.chosen]
            r.verdicts[r.chosen] = {"passed": False, "reasons": [*verdict["reasons"], *reasons]}
            r.pick = None

    @staticmethod
    def _scorecard(r: BuildResult, pick: str) -> dict:
        """The exported ``auto``'s scorecard: its selection, evidence, no-harm verdict and long
        runs."""
        from autoscale.search.objective import OBJECTIVE_DOC
        from autoscale.search.trials import member_summary

        ev_obj = ev.objective_of(r.evidence, r.searched, r.weights)
        on_validation = ev.objective_of(r.evidence, r.validation, r.weights) if r.validation else {}
        scorecard = {
            "objective": OBJECTIVE_DOC,
            "selection": {
                "instances": "test instances (seeds 100-102) of every member",
                "steps": r.settings.steps,
                "ranked_on": f"{r.ranked_on} members",
                "objective_searched": r.objective,
                "objective_left_out": r.zero_shot,
                "objective_validation": r.objective_validation,
                "objective_test": r.objective_test,
            },
            "evidence": {
                "instances": "fresh seeds (test seeds + 1000) of the train and validation members, "
                "never used for training or selection",
                "steps": r.settings.steps,
                "objective_searched": ev_obj[pick],
                # left out of training and measured here: the validation members
                **(
                    {
                        "objective_left_out": on_validation[pick],
                        "objective_validation": on_validation[pick],
                    }
                    if on_validation
                    else {}
                ),
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
        return scorecard

    def export(self, r: BuildResult, dest_root: Path, built_by: str):
        """Write ``r.pick`` as ``dest_root/auto`` (an extra rule with its parameters, an agent's or
        the suite search's folder renamed, or a built-in rule with its defaults; the episode's
        scale bounds with it), its selection, evidence, no-harm verdict and long runs in the
        manifest; check that it loads. Returns the manifest."""
        from autoscale.scalers import make_scaler
        from autoscale.scalers.policies import read_manifest, staged_policy, write_manifest
        from autoscale.search.export import export_parametric

        if r.pick is None or r.evidence is None or r.evidence_acceptance is None:
            raise ValueError("nothing to export: no candidate passed")
        pick, ep = r.pick, self.member.episode
        bounds = ep.scale_kwargs()
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
        scorecard = self._scorecard(r, pick)
        manifest = read_manifest(dest_root / "auto")
        workload = {
            **manifest.workload,
            "suite": self.suite.name,
            "members": r.searched,
            "left_out": r.left_out,
            "validation": r.validation,
            "test": r.test,
            "built_by": built_by,
        }
        manifest = dataclasses.replace(
            manifest, workload=workload, scorecard=json.loads(json.dumps(scorecard, default=float))
        )
        write_manifest(dest_root / "auto", manifest)
        make_scaler(str(dest_root / "auto"), device="cpu")  # it loads
        return manifest
