"""``LossScaleEnv``: an agent sets the loss scale of real mixed-precision training steps."""

from __future__ import annotations

import time
from typing import Any

from autoscale.envs.base import ScaleEnvBase
from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.scalers.catalog import make_scaler
from autoscale.scalers.controller import StepStats
from autoscale.scalers.features import FeatureExtractor

__all__ = ["LossScaleEnv"]


class LossScaleEnv(ScaleEnvBase):
    """Loss scaling as a control problem over real training steps.

    An episode is ``episode.steps`` real optimizer steps (forward and backward under autocast,
    unscale, clip, step) of one workload instance: the spec's workload with the instance's seed,
    after ``start`` warm-up steps driven by the ``warmup`` rule. Each reset restores an in-memory
    snapshot of that point (model, optimizer, RNG, data cursor), so episodes of an instance start
    from identical states and a reset costs no training step.

    ## Action Space
    A change of log2(scale) for the next step. Discrete (default): ``Discrete(len(deltas))``
    choosing one of ``deltas`` bits (``-2, -1, 0, +1, +2``). Continuous: ``Box(-1, 1, (1,))`` scaled
    to ``max_delta`` bits and rounded to ``resolution`` bits. The scale is clamped to
    ``[min_scale, max_scale]`` of the episode spec.

    ## Observation Space
    ``Box(-4, 4, (11,), float32)``: the features of
    :class:`~autoscale.scalers.features.FeatureExtractor` (version 1), the same code exported
    policies run: log2 scale, last overflow, overflow rate, clean steps since the last overflow,
    headroom of the gradient amax to the fp16 maximum, distance of the gradient RMS above the fp16
    normal minimum, whether statistics are known, non-finite loss (fails at any scale) and its rate,
    loss trend, progress.

    ## Rewards
    Per step, from the scorecard's step metrics (weights in the spec's ``reward``):
    ``-skip x skipped - precision x precision_loss + progress x (log prev_loss - log loss)
    - divergence x diverged``.

    ## Starting State
    The instance's snapshot; the first observation describes that point at the scale the warm-up
    rule reached there (``init_scale`` for instances that start at step 0).
    Instances are drawn uniformly from the chosen set (``train`` by default, ``test`` for
    evaluation; the test set is never trained on), or named with ``options={"instance": NAME}``.

    ## Episode End
    ``terminated`` when training diverges (three non-finite losses in a row, or non-finite
    parameters at the end); ``truncated`` after ``episode.steps`` steps.

    ## Version History
    * v0: first version (feature spec 1).

    Args:
        spec: Path or name of a YAML spec in ``envs/``, a dict, or an :class:`EnvSpec`.
        instances: ``"train"``, ``"test"``, or a list of instance names.
        warmup: Rule that drives the warm-up steps before an instance's start point.
    """

    def __init__(
        self,
        spec: str | EnvSpec | dict,
        instances: str | list[str] = "train",
        warmup: str = "torch",
        record: bool = False,
    ) -> None:
        super().__init__(spec, instances)
        self.warmup = warmup
        self.record = record
        make_scaler(warmup, device="cpu")  # fail early on an unknown rule
        self._cache: dict[str, tuple[Any, Any, dict[str, Any], float]] = {}
        self.run = None
        self.records: list[Any] = []
        self._wall = 0.0

    def prepare(self, instance: InstanceSpec):
        """Build (once) the training run of ``instance`` and its start snapshot."""
        if instance.name in self._cache:
            return self._cache[instance.name]
        from autoscale.training import TrainingRun

        ep = self.env_spec.episode
        workload = self.env_spec.workload.replace(seed=instance.seed)
        run = TrainingRun(
            workload,
            "static",
            record=self.record,
            init_scale=ep.init_scale,
            min_scale=ep.min_scale,
            max_scale=ep.max_scale,
        )
        rule = make_scaler(
            self.warmup,
            device="cpu",
            init_scale=ep.init_scale,
            min_scale=ep.min_scale,
            max_scale=ep.max_scale,
        )
        fx = FeatureExtractor()
        scale = run.scaler.get_scale()
        for _ in range(instance.start):
            run.scaler.set_scale(scale)
            rec = run.step()
            fx.observe(rec.stats)
            scale = rule.controller.step(rec.stats)
        entry = (run, run.snapshot(), fx.state_dict(), scale)
        self._cache[instance.name] = entry
        return entry

    def _start(self, instance: InstanceSpec) -> tuple[float, dict[str, Any]]:
        run, snap, fx_state, scale = self.prepare(instance)
        run.restore(snap)
        self.run = run
        self.records = []
        self._wall = 0.0
        return scale, fx_state

    def _advance(self, scale: float) -> tuple[StepStats, float, bool]:
        t0 = time.perf_counter()
        self.run.scaler.set_scale(scale)
        self.run.scaler.guard_rule = self.guard_rule  # the scaler lowers the step's scale itself
        rec = self.run.step()
        self._wall += time.perf_counter() - t0
        self.records.append(rec)
        diverged = len(self.records) >= self.episode_steps and not self.run.params_finite()
        return rec.stats, rec.precision_loss, diverged

    def _peek_loss(self) -> float:
        return self.run.peek_loss()  # the next step's forward, run now; its step continues it

    def episode_records(self) -> list:
        """The episode's steps (:class:`~autoscale.training.StepRecord`)."""
        return list(self.records)

    def scorecard(self):
        """The scorecard of the episode so far (real steps; eval loss measured now)."""
        from autoscale.training import Scorecard

        return Scorecard.from_records(
            self.records, eval_loss=self.run.eval_loss(), hit_min=self.hit_min, wall_s=self._wall
        )
