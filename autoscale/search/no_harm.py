"""The no-harm check: nothing is exported that harms a long clean run (docs/design.md 3.8;
docs/search.md, "No harm"). :class:`NoHarmCheck` runs :func:`no_harm_workloads` next to ``torch``
and judges them with the ``auto`` build's own check (:mod:`autoscale.training.long_run`). A
candidate is first screened on the replay of torch's cached runs, with a wide
:data:`SCREEN_MARGIN`: replay is pessimistic near the overflow threshold
(``experiments/results/replay_fidelity.md``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autoscale.errors import ConfigError
from autoscale.search.budget import Ledger, percent
from autoscale.search.timing import NoHarmPlan, Timings
from autoscale.training.bar import seed_noise
from autoscale.training.long_run import MEASURE, kept_share, long_run_harm, measured_run
from autoscale.training.scorecard import Scorecard

__all__ = [
    "OutOfTime",
    "NO_HARM_STEPS",
    "SCREEN_MARGIN",
    "no_harm_workloads",
    "no_harm_label",
    "no_harm_proxy",
    "Verdict",
    "Check",
    "NoHarmCheck",
]

NO_HARM_STEPS = 1000
SCREEN_MARGIN = 0.02  # replay refuses only what skips this much more than torch
NO_HARM_VERSION = 2  # 2: torch's cached runs carry the kept share against the fp32 reference
DRIFT = {"down": 20.0, "up": 8.0}  # bits of the drift run's loss weight: down, then up


class OutOfTime(Exception):
    """A check (or torch's run it needs) reached its deadline: nothing of it is kept."""


def _until(deadline: float | None) -> Callable[[Any], bool] | None:
    """A :meth:`TrainingRun.run` callback that stops the run at ``deadline`` (None: never)."""
    if deadline is None:
        return None
    return lambda rec: time.monotonic() < deadline


def _finished(card: Any, steps: int, what: str) -> None:
    if card.steps < steps:
        raise OutOfTime(f"{what} stopped at the budget's end after {card.steps} of {steps} steps")


def no_harm_workloads(members: list[Any], steps: int = NO_HARM_STEPS) -> tuple[Any, ...]:
    """The check's workloads: ``mlp`` and each model of ``members`` clean, and ``mlp`` with
    drifting gradients (:data:`DRIFT`), each with a warm-up and a cosine decay."""
    from autoscale.training import WorkloadSpec

    schedule = {"warmup": max(1, steps // 10), "decay": steps - max(1, steps // 10)}
    out: dict[str, Any] = {}
    for m in members:
        w = m.workload
        out.setdefault(w.model, w.replace(scenario="clean", scenario_params=schedule, seed=0))
    if "mlp" not in out:
        ref = members[0].workload
        out = {
            "mlp": WorkloadSpec(
                model="mlp",
                scenario="clean",
                scenario_params=schedule,
                dtype=ref.dtype,
                device=ref.device,
                batch_size=32,
                lr=1e-3,
            ),
            **out,
        }
    mlp = out["mlp"]
    drift = mlp.replace(scenario="drift", scenario_params={**schedule, **DRIFT, "length": steps})
    return (*out.values(), drift)


def no_harm_label(workload: Any) -> str:
    """How the check names a workload: its model, with its scenario unless it is clean."""
    return (
        workload.model if workload.scenario == "clean" else f"{workload.model}/{workload.scenario}"
    )


def no_harm_proxy(workload: Any) -> Any | None:
    """What stands in for ``workload`` when a budget cannot afford its long runs: ``gpt2-tiny``
    for a language model; None for the small presets (cheap anyway) and a user's workload
    (nothing stands in for it)."""
    from autoscale.training.presets import PRESETS, is_user_workload

    if is_user_workload(workload.model):
        return None
    preset = PRESETS.get(workload.model)
    if (preset is not None and preset.kind != "lm") or workload.model == "gpt2-tiny":
        return None
    return workload.replace(
        model="gpt2-tiny", batch_size=4, seq_len=64, lr=1e-3, init="random", data=None
    )


@dataclass
class Verdict:
    """What the check found for one candidate.

    Attributes:
        passed: Every workload within the rule.
        reasons: Why it failed, one line per broken rule (empty when it passed).
        runs: Workload model -> {"candidate": [scorecards], "torch": [scorecards]} as dicts.
        screened: Refused on replay, without real runs.
        where: What the check ran on, where it is not long real runs.
        shape: The shape of the check that reached it (empty: a check on records).
    """

    label: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    runs: dict[str, dict[str, list[dict]]] = field(default_factory=dict)
    screened: bool = False
    where: str = ""
    shape: str = ""

    def summary(self) -> str:
        if self.passed:
            parts = []
            for model, r in self.runs.items():
                c, t = r["candidate"][0], r["torch"][0]
                noise = r.get("noise")
                within = f", seed noise {noise:.2g}" if noise else ""  # (what the check allows)
                second = (
                    f"eval loss {c['eval_loss']:.4g} (torch {t['eval_loss']:.4g}{within})"
                    if "eval_loss" in c
                    else f"below fp16's range {100 * c['precision_loss']:.2f}% "
                    f"(torch {100 * t['precision_loss']:.2f}%)"
                )
                if "kept" in c:  # long real runs: of the elements an fp32 backward leaves non-zero
                    second += (
                        f", kept at fp16 precision {percent(c['kept'])} "
                        f"(torch {percent(t.get('kept'))})"
                    )
                parts.append(
                    f"{model}: skipped {100 * c['skip_rate']:.2f}% (torch {100 * t['skip_rate']:.2f}%), "
                    + second
                )
            how = f" {self.where}" if self.where else ""
            return f"{self.label} passed the no-harm check{how}: " + "; ".join(parts)
        how = self.where or ("on replay of torch's long runs" if self.screened else "in long runs")
        return f"{self.label} fails the no-harm check {how}: " + "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Check(Protocol):
    """What :func:`~autoscale.search.choose.choose` asks of a no-harm check (:class:`NoHarmCheck`
    or :class:`~autoscale.search.no_harm_records.RecordsCheck`). A verdict is reused only by a
    check of the same ``shape`` attribute, where it has one."""

    def screen(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict: ...

    def check(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict: ...

    def cost(self, timings: Timings, candidates: int = 1) -> float: ...


class NoHarmCheck:
    """Runs a plan's :class:`~autoscale.search.timing.NoHarmPlan`, caching ``torch``'s runs.

    Args:
        folder: The artifacts folder (``folder/no-harm`` keeps torch's runs and traces).
        ledger: Time spent goes to ``work:no-harm``.
        scale_kw: The episode's scale bounds, which the torch reference is built with.
    """

    def __init__(
        self,
        no_harm: NoHarmPlan,
        folder: Path,
        ledger: Ledger,
        scale_kw: dict[str, float],
        progress: bool = False,
    ) -> None:
        self.no_harm, self.ledger, self.scale_kw, self.progress = (
            no_harm,
            ledger,
            scale_kw,
            progress,
        )
        self.cache = folder / "no-harm"
        self.cache.mkdir(parents=True, exist_ok=True)
        self.folder = folder

    @property
    def shape(self) -> str:
        """What a verdict holds for: the workloads, steps, measure and a digest of the rest."""
        data = {
            "plan": self.no_harm.to_dict(),
            "scale": self.scale_kw,
            "version": NO_HARM_VERSION,
            "measure": MEASURE,
        }
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        labels = ",".join(no_harm_label(w) for w in self.no_harm.workloads)
        return f"{labels}|{self.no_harm.steps}|{MEASURE}|{digest}"

    # ------------------------------------------------------------------ torch's reference runs
    def _key(self, workload: Any, seed: int) -> str:
        import torch

        data = {
            "workload": workload.replace(seed=seed).to_dict(),
            "steps": self.no_harm.steps,
            "scale": self.scale_kw,
            "version": NO_HARM_VERSION,
            "measure": MEASURE,
            "torch": torch.__version__,
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:20]

    def cached(self, workload: Any, seed: int) -> bool:
        """Whether torch's run of ``workload`` with ``seed`` is in the cache."""
        return (self.cache / f"torch-{self._key(workload, seed)}.json").is_file()

    def reference(
        self, workload: Any, seed: int, deadline: float | None = None
    ) -> tuple[dict[str, Any], Any]:
        """torch's measured run (``{"card": Scorecard, "kept": [...]}``, see
        :func:`~autoscale.training.long_run.measured_run`) and its recorded trace (run and cached
        if missing; a run that reaches ``deadline`` first raises :class:`OutOfTime` and is not
        cached)."""
        from autoscale.envs.traces import Trace
        from autoscale.search.storage import file_lock

        key = self._key(workload, seed)
        card_path = self.cache / f"torch-{key}.json"
        trace_path = self.cache / f"torch-{key}.npz"
        with file_lock(self.folder / "locks" / f"no-harm-{key}.lock"):
            if card_path.is_file() and trace_path.is_file():
                try:
                    data = json.loads(card_path.read_text())
                    run = {"card": Scorecard.from_dict(data["card"]), "kept": list(data["kept"])}
                    return run, Trace.load(trace_path)
                except (ConfigError, ValueError, KeyError, TypeError):
                    card_path.unlink(missing_ok=True)  # damaged: run it again
            run, trace = self._run_torch(workload, seed, deadline)
            trace.save(trace_path)
            tmp = card_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"card": run["card"].to_dict(), "kept": run["kept"]}))
            tmp.replace(card_path)
        return run, trace

    def _run_torch(
        self, workload: Any, seed: int, deadline: float | None = None
    ) -> tuple[dict[str, Any], Any]:
        import numpy as np

        from autoscale.envs.spec import EnvSpec
        from autoscale.envs.traces import Trace, instance_trace
        from autoscale.scalers import make_scaler
        from autoscale.scalers.features import FEATURE_VERSION, FeatureExtractor
        from autoscale.training import HIST_EDGES, TrainingRun

        w = workload.replace(seed=seed)
        run = TrainingRun(
            w,
            make_scaler("torch", device=_device(w), collect_stats=True, **self.scale_kw),
            record=True,
        )
        with self.ledger.track("work:no-harm"):
            measured = self._measured(run, deadline)
        card = measured["card"]
        _finished(card, self.no_harm.steps, f"torch's {no_harm_label(workload)} run")
        spec = self._replay_spec(workload)
        inst = instance_trace(
            f"no-harm-s{seed}",
            seed,
            0,
            run.records,
            eval_loss=card.eval_loss,
            start_scale=run.records[0].scale,
            start_features=FeatureExtractor().state_dict(),
        )
        spec = EnvSpec.from_dict(spec)
        trace = Trace(
            spec.to_dict(),
            {inst.name: inst},
            np.asarray(HIST_EDGES, dtype=np.float64),
            FEATURE_VERSION,
        )
        return {"card": card, "kept": measured["kept"]}, trace

    def _measured(self, run: Any, deadline: float | None) -> dict[str, Any]:
        """The check's steps of ``run``, precision measured against the fp32 reference."""
        return measured_run(
            run, self.no_harm.steps, progress=self.progress, callback=_until(deadline)
        )

    def _replay_spec(self, workload: Any) -> dict[str, Any]:
        return {
            "name": f"no-harm-{workload.model}",
            "workload": workload.to_dict(),
            "episode": {"steps": self.no_harm.steps, **self.scale_kw},
            "instances": {
                "train": [{"name": f"no-harm-s{s}", "seed": s} for s in self.no_harm.seeds[:1]],
                "test": [{"name": f"no-harm-s{s}", "seed": s} for s in self.no_harm.seeds[1:]],
            },
        }

    # ------------------------------------------------------------------ the check
    def screen(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict:
        """The check's skip rule on the replay of torch's runs (run first where not cached)."""
        from autoscale.envs.episodes import drive_episode
        from autoscale.envs.replay_env import ReplayEnv

        reasons = []
        for w in self.no_harm.workloads:
            for seed in self.no_harm.candidate_seeds:
                ref, trace = self.reference(w, seed, deadline)
                skip_ref = ref["card"].skip_rate
                (inst,) = trace.instances
                env = ReplayEnv(trace.spec, trace, instances=[inst])
                with self.ledger.track("work:replay"):
                    card, _ = drive_episode(env, factory(), inst)
                if card.skip_rate > skip_ref + SCREEN_MARGIN:
                    reasons.append(
                        f"{no_harm_label(w)} seed {seed}: replay predicts {100 * card.skip_rate:.2f}% skipped "
                        f"steps, torch {100 * skip_ref:.2f}% (+{100 * SCREEN_MARGIN:.1f}% "
                        "allowed on replay)"
                    )
        return Verdict(label, not reasons, reasons, screened=True, shape=self.shape)

    def check(
        self, factory: Callable[[], Any], label: str, deadline: float | None = None
    ) -> Verdict:
        """Run the candidate's long clean runs and judge them against torch's. A run that reaches
        ``deadline`` (``time.monotonic()``) before its last step raises :class:`OutOfTime`: a
        budget's end stops a check rather than letting it overrun."""
        from autoscale.training import TrainingRun

        reasons: list[str] = []
        runs: dict[str, dict[str, list[dict]]] = {}
        for w in self.no_harm.workloads:
            refs = {s: self.reference(w, s, deadline)[0] for s in self.no_harm.seeds}
            noise = seed_noise([r["card"].eval_loss for r in refs.values()])
            mine = []
            for seed in self.no_harm.candidate_seeds:
                run = TrainingRun(w.replace(seed=seed), _on_device(factory(), w))
                with self.ledger.track("work:no-harm"):
                    measured = self._measured(run, deadline)
                _finished(measured["card"], self.no_harm.steps, f"its {no_harm_label(w)} run")
                mine.append(measured)
                for why in long_run_harm(measured, refs[seed], noise, self.no_harm.steps):
                    reasons.append(f"{no_harm_label(w)} seed {seed}: {why}")
            runs[no_harm_label(w)] = {
                "candidate": [_shown(r) for r in mine],
                "torch": [_shown(refs[s]) for s in self.no_harm.candidate_seeds],
                "noise": noise,
            }
        return Verdict(label, not reasons, reasons, runs, shape=self.shape)

    def cost(self, timings: Timings, candidates: int = 1) -> float:
        """Seconds the check still needs for ``candidates`` candidates (torch cached or not)."""
        return self.no_harm.cost(timings, candidates, self.cached)


def _shown(run: dict[str, Any]) -> dict[str, Any]:
    """What a verdict keeps of a measured run: its scorecard and its kept share."""
    return {**run["card"].to_dict(), "kept": kept_share(run)}


def _device(workload: Any) -> str:
    from autoscale.training.run import resolve_device

    return resolve_device(workload.device).type


def _on_device(scaler: Any, workload: Any) -> Any:
    """A candidate built on the CPU (for replay), its fresh rule moved to the workload's device."""
    from autoscale.scalers import LossScaler

    device = _device(workload)
    if scaler.device == device:
        return scaler
    return LossScaler(
        scaler.rule,
        device,
        init_scale=scaler.init_scale,
        min_scale=scaler.min_scale,
        max_scale=scaler.max_scale,
        name=scaler.name,
    )
