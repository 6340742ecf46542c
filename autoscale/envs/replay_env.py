"""``ReplayEnv``: the loss-scale environment over recorded traces, for fast search."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from autoscale.envs.base import ScaleEnvBase, step_reward
from autoscale.envs.knobs import EpisodeKnobs, Knobs, weighted
from autoscale.envs.spec import EnvSpec, InstanceSpec
from autoscale.envs.traces import InstanceTrace, Trace
from autoscale.errors import ConfigError
from autoscale.scalers.controller import StepStats
from autoscale.scalers.loss_guard import is_spike, step_scale_host

__all__ = ["ReplayEnv", "precision_table"]

LOG2_FP16_MIN_NORMAL = -14.0
TABLE_LO, TABLE_HI = -24, 64  # integer log2 scales tabulated; others are interpolated
TABLE_SPAN = TABLE_HI - TABLE_LO
WARM_EVERY = 128  # keep the features state every this many recorded steps, for late starts


def precision_table(
    hist: np.ndarray,
    edges: np.ndarray,
    log2_scales: np.ndarray,
    log2_min_normal: float = LOG2_FP16_MIN_NORMAL,
) -> np.ndarray:
    """Precision loss of each traced step at each log2 scale, from the gradient histograms.

    The share of non-zero gradient elements with ``|g| * S`` below the normal minimum (2^-14 for
    fp16: the scorecard's definition), with mass spread uniformly in log2 inside each 1-bit bin.
    Shape ``(steps, len(log2_scales))``.
    """
    totals = hist.sum(axis=1, keepdims=True)
    cum = np.concatenate([np.zeros((hist.shape[0], 1)), np.cumsum(hist, axis=1)], axis=1)
    cum = np.divide(cum, totals, out=np.zeros_like(cum), where=totals > 0)
    x = log2_min_normal - np.asarray(log2_scales, dtype=np.float64)
    return (
        np.stack([np.interp(x, edges, row) for row in cum]) if len(cum) else np.zeros((0, len(x)))
    )


# Replay makes a StepStats per step and a StepRecord per step of an episode; a frozen dataclass's
# __init__ sets each field with object.__setattr__, a large share of a long replayed episode's
# time. The makers below build the same objects (equal fields, equal ==, repr and hash) by setting
# their __dict__ at once, and fall back to the constructor if the class is not the plain frozen
# dataclass with the fields they fill.


def _plain_defaults(cls: type, filled: tuple[str, ...]) -> dict[str, Any] | None:
    """The defaults of ``cls``'s other fields if it is a plain dataclass whose fields are
    ``filled`` then defaulted ones (no slots, factories or __post_init__); else None."""
    fields = dataclasses.fields(cls)
    rest = fields[len(filled) :]
    plain = (
        tuple(f.name for f in fields[: len(filled)]) == filled
        and all(f.default is not dataclasses.MISSING for f in rest)
        and all(f.default_factory is dataclasses.MISSING for f in fields)
        and "__slots__" not in cls.__dict__
        and not hasattr(cls, "__post_init__")
    )
    return {f.name: f.default for f in rest} if plain else None


def _stats_maker() -> Callable[..., StepStats]:
    """``make(step, scale, found_inf, grad_amax, grad_rms, loss, loss_seen[, guarded[,
    spiked]])`` == ``StepStats(...)``."""
    names = (
        "step",
        "scale",
        "found_inf",
        "grad_amax",
        "grad_rms",
        "loss",
        "loss_seen",
        "guarded",
        "spiked",
    )
    if _plain_defaults(StepStats, names) != {}:
        return StepStats
    new, set_dict = object.__new__, object.__setattr__

    def make(
        step, scale, found_inf, grad_amax, grad_rms, loss, loss_seen, guarded=False, spiked=False
    ):
        obj = new(StepStats)
        set_dict(
            obj,
            "__dict__",
            {
                "step": step,
                "scale": scale,
                "found_inf": found_inf,
                "grad_amax": grad_amax,
                "grad_rms": grad_rms,
                "loss": loss,
                "loss_seen": loss_seen,
                "guarded": guarded,
                "spiked": spiked,
            },
        )
        return obj

    return make


def _record_maker() -> Callable[[StepStats, float, float], Any]:
    """``make(stats, precision, loss)`` == the :class:`~autoscale.training.StepRecord` of a
    replayed step: ``StepRecord(step=stats.step, ..., loss=loss (the training loss),
    precision_loss=precision, lr=nan, wall_s=0.0, stats=stats)``."""
    from autoscale.training import StepRecord

    names = ("step", "scale", "found_inf", "loss", "loss_nonfinite", "grad_amax", "grad_rms")
    names += ("precision_loss", "lr", "wall_s", "stats")
    defaults = _plain_defaults(StepRecord, names)
    new, set_dict = object.__new__, object.__setattr__

    def make(stats: StepStats, precision: float, loss: float) -> Any:
        values = {
            "step": stats.step,
            "scale": stats.scale,
            "found_inf": stats.found_inf,
            "loss": loss,
            "loss_nonfinite": stats.loss_nonfinite,
            "grad_amax": stats.grad_amax,
            "grad_rms": stats.grad_rms,
            "precision_loss": precision,
            "lr": math.nan,
            "wall_s": 0.0,
            "stats": stats,
        }
        if defaults is None:
            return StepRecord(**values)
        obj = new(StepRecord)
        set_dict(obj, "__dict__", {**values, **defaults})
        return obj

    return make


_make_stats = _stats_maker()


class ReplayEnv(ScaleEnvBase):
    """The :class:`~autoscale.envs.loss_scale_env.LossScaleEnv` problem answered from traces.

    Same spaces, features and reward as ``LossScaleEnv``. A step at scale S overflows when the
    loss was non-finite or ``log2 S`` exceeds the traced overflow threshold; its precision loss is
    read from the traced gradient histogram at S; loss and gradient statistics are the traced ones.
    What replay cannot show: how a skipped or imprecise step changes the later trajectory (the
    trace continues as recorded). ``experiments/benchmarks/replay_fidelity.py`` measures the gap.

    ## Action Space / Observation Space / Rewards
    As ``LossScaleEnv``.

    ## Starting State
    An instance drawn from the set, at its start point as the real env has it (the scale and
    features its warm-up reached, stored in the trace). A trace longer than an episode holds later
    points of the same run: ``options={"offset": k}`` starts the episode ``k`` steps into it, and
    with ``random_offset`` episodes start at a random step of it; features and scale are carried
    on through the recorded steps before the start, as the run had them there.

    ## Episode End
    ``truncated`` after ``episode.steps`` steps; never terminated (a trace has no divergence).

    ## Version History
    * v0: first version (trace format 1, feature spec 1).

    Args:
        spec: The env spec (path, name, dict or EnvSpec); must match the trace's workload.
        trace: A :class:`Trace` or the path of one (``autoscale record``).
        instances: ``"train"``, ``"test"`` or instance names; each must be in the trace.
        random_offset: Start episodes at random points of longer traces.
        knobs: Scenario knobs drawn per episode (:class:`~autoscale.envs.knobs.Knobs`): a loss
            weight that moves over the episode, a spike, bad batches, applied to the recorded
            steps; ``info["knobs"]`` at reset says what was drawn (None: as recorded).
    """

    def __init__(
        self,
        spec: str | EnvSpec | dict,
        trace: str | Trace,
        instances: str | list[str] = "train",
        random_offset: bool = False,
        knobs: Knobs | None = None,
    ) -> None:
        super().__init__(spec, instances)
        self.trace = trace if isinstance(trace, Trace) else Trace.load(trace)
        if self.trace.spec.get("workload") != self.env_spec.workload.to_dict():
            raise ConfigError(
                f"trace was recorded for workload {self.trace.spec.get('workload')}, the spec '{self.env_spec.name}' "
                f"has {self.env_spec.workload.to_dict()}; record a trace for this spec"
            )
        self.random_offset = random_offset
        self.knobs = knobs
        self._knobs: EpisodeKnobs | None = None  # this episode's draw
        self._scales = np.arange(TABLE_LO, TABLE_HI + 1, dtype=np.float64)
        from autoscale.training.run import MIN_NORMAL

        # the workload dtype's normal minimum (the precision loss's threshold)
        self.log2_min_normal = log2_min_normal = math.log2(MIN_NORMAL[self.env_spec.workload.dtype])
        self._tables: dict[str, tuple[InstanceTrace, list[tuple], dict[str, list]]] = {}
        for inst in self.instances:
            t = self.trace.instance(inst.name)
            if t.steps < self.episode_steps:
                raise ConfigError(
                    f"trace of instance '{inst.name}' has {t.steps} steps, fewer than an episode ({self.episode_steps}); "
                    "record more steps"
                )
            table = precision_table(
                t.hist, self.trace.hist_edges, self._scales, log2_min_normal
            ).tolist()
            cols = {
                k: getattr(t, k).tolist()
                for k in ("threshold", "nonfinite", "loss", "amax", "rms", "scale")
            }
            # the loss the scaler saw: what rules, guards and features read (``loss``, the
            # training loss, goes into the episode's records and scorecard)
            cols["step_loss"] = t.scaler_loss.tolist()
            # what _advance reads of step i, in one tuple: one index a step, not six
            rows = list(
                zip(
                    cols["nonfinite"],
                    cols["threshold"],
                    cols["step_loss"],
                    cols["amax"],
                    cols["rms"],
                    table,
                    strict=True,
                )
            )
            self._tables[inst.name] = (t, rows, cols)
        self._cur: tuple[InstanceTrace, list[tuple], dict[str, list]] | None = None
        self._offset = 0
        self._requested_offset: int | None = None
        self._requested_knobs: EpisodeKnobs | None = None
        self.records: list[tuple] = []
        self._episode_records: tuple | None = None
        self._make_record: Callable[[StepStats, float, float], Any] | None = None
        # instance -> offset (multiples of WARM_EVERY) -> (scale, features state) there
        self._warm: dict[str, dict[int, tuple[float, dict[str, Any]]]] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """As :meth:`ScaleEnvBase.reset`; ``options={"offset": k}`` starts ``k`` steps into the
        instance's trace (``info["offset"]`` says where the episode started), and
        ``options={"knobs": draw}`` replays another episode's draw (:attr:`episode_knobs`: a
        reference run on the same knobs) instead of drawing."""
        offset = (options or {}).get("offset")
        self._requested_offset = None if offset is None else int(offset)
        self._requested_knobs = (options or {}).get("knobs")
        obs, info = super().reset(seed=seed, options=options)
        drawn = self._knobs.drawn if self._knobs is not None else None
        return obs, {**info, "offset": self._offset, "knobs": drawn}

    def _start(self, instance: InstanceSpec) -> tuple[float, dict[str, Any]]:
        self._cur = self._tables[instance.name]
        t, _, cols = self._cur
        last = t.steps - self.episode_steps  # the latest start that fits a whole episode
        if self._requested_offset is not None:
            if not 0 <= self._requested_offset <= last:
                raise ConfigError(
                    f"offset {self._requested_offset} is outside instance '{instance.name}''s "
                    f"trace: an episode of {self.episode_steps} steps starts at 0..{last}"
                )
            self._offset = self._requested_offset
        else:
            self._offset = int(self.np_random.integers(last + 1)) if self.random_offset else 0
        # the instance's start point, as the real env has it after its warm-up, carried on through
        # the recorded steps before the window; from the nearest kept point (the same states: a
        # features state round-trips exactly)
        kept = self._warm.setdefault(instance.name, {})
        at = self._offset - self._offset % WARM_EVERY
        while at and at not in kept:
            at -= WARM_EVERY
        if at in kept:
            scale, state = kept[at]
            self.features.load_state_dict(state)
        else:
            scale = t.start_scale
            self.features.load_state_dict(t.start_features)
        for i in range(at, self._offset):
            self.features.update(self._stats(cols, i, cols["scale"][i]))
            scale = cols["scale"][i]
            if (i + 1) % WARM_EVERY == 0:
                kept[i + 1] = (scale, self.features.state_dict())
        self.records = []
        self._episode_records = None
        if self._requested_knobs is not None:
            if len(self._requested_knobs.gain) < self.episode_steps:
                raise ConfigError(
                    f"a knobs draw of {len(self._requested_knobs.gain)} steps cannot drive an "
                    f"episode of {self.episode_steps}"
                )
            self._knobs = self._requested_knobs
        else:
            self._knobs = (
                self.knobs.draw(self.np_random, self.episode_steps)
                if self.knobs is not None
                else None
            )
        return scale, self.features.state_dict()

    @property
    def episode_knobs(self) -> EpisodeKnobs | None:
        """This episode's knobs draw (None: as recorded)."""
        return self._knobs

    def _stats(self, cols: dict[str, list], i: int, scale: float) -> StepStats:
        nonfinite = cols["nonfinite"][i]
        overflow = nonfinite or math.log2(scale) > cols["threshold"][i]
        amax = math.inf if overflow else cols["amax"][i]
        rms = math.inf if overflow else cols["rms"][i]
        return _make_stats(i, scale, overflow, amax, rms, cols["step_loss"][i], True)

    def _advance(self, scale: float) -> tuple[StepStats, float, bool]:
        # _stats inlined, with log2(scale) taken once: this runs once a replayed step
        i = self._offset + self._t
        nonfinite, threshold, loss, amax, rms, row = self._cur[1][i]
        gain = 0.0
        if self._knobs is not None:  # the step under this episode's loss weight (knobs.py)
            gain = self._knobs.gain[self._t]
            if self._knobs.bad[self._t]:
                nonfinite, loss = True, math.inf
            amax, rms, loss = weighted(amax, rms, loss, gain)
            threshold -= gain
        guarded = spiked = False
        if self.guard_rule is not None:  # the rule's scale for this step, from its loss
            spiked = is_spike(self.guard_rule, loss)
            step_scale = step_scale_host(self.guard_rule, scale, loss, self.bounds)
            scale, guarded = step_scale, step_scale < scale
        log2_scale = math.log2(scale)
        if nonfinite or log2_scale > threshold:
            stats = _make_stats(i, scale, True, math.inf, math.inf, loss, True, guarded, spiked)
            precision = math.nan
        elif spiked:  # skipped for its loss, as the scaler skips it: no update, no precision
            stats = _make_stats(i, scale, True, amax, rms, loss, True, guarded, True)
            precision = math.nan
        else:
            stats = _make_stats(i, scale, False, amax, rms, loss, True, guarded)
            pos = log2_scale + gain - TABLE_LO  # clipped to [0, span] (as min(max(pos, 0.0), span))
            if pos < 0.0:
                pos = 0.0
            elif pos > TABLE_SPAN:
                pos = TABLE_SPAN
            lo = int(pos)
            frac = pos - lo
            precision = (
                row[lo]
                if frac == 0.0 or lo + 1 >= len(row)
                else row[lo] * (1 - frac) + row[lo + 1] * frac
            )
        self.records.append((stats, precision))
        return stats, precision, False

    def _peek_loss(self) -> float:
        loss = self._cur[1][self._offset + self._t][2]  # the loss the scaler saw, next step
        if self._knobs is not None:
            if self._knobs.bad[self._t]:
                return math.inf
            loss = weighted(0.0, 0.0, loss, self._knobs.gain[self._t])[2]
        return loss

    def step(self, action):
        """:meth:`ScaleEnvBase.step` in one frame: the same step, books, observation, reward and
        info (``tests/envs`` holds them equal step by step), without the generic path's calls.
        With a per-step guard set (a rule's driver, not an agent), or for an agent acting at scale
        time, the generic path runs."""
        if self.instance is None or self.guard_rule is not None or self.scale_time:
            return super().step(action)
        scale = self.bounds.clamp(self.scale * 2.0 ** self.action_map.delta(action))
        prev_loss = self._prev_loss
        stats, precision, _ = self._advance(scale)  # replay never diverges by itself
        # ScaleEnvBase._take's books
        self.last_stats = stats
        found_inf = stats.found_inf
        if found_inf and scale <= self.min_scale:
            self.hit_min = True
        self._t = t = self._t + 1
        loss = stats.loss
        finite_loss = loss == loss and loss != math.inf and loss != -math.inf
        self._nonfinite_run = run = 0 if finite_loss else self._nonfinite_run + 1
        diverged = run >= 3
        fx = self.features
        fx.update(stats)
        if not found_inf and finite_loss:
            self._prev_loss = loss
        self.scale = scale
        # ScaleEnvBase.step_at's returns
        obs = np.asarray(self.stack.push(fx.features(scale)), dtype=np.float32)
        reward = step_reward(self.weights, found_inf, precision, loss, prev_loss, diverged)
        info = {
            "instance": self.instance.name,
            "scale": scale,
            "skipped": found_inf,
            "precision_loss": precision,
            "loss": loss,
        }
        return obs, float(reward), diverged, t >= self.episode_steps and not diverged, info

    def episode_records(self) -> list:
        """The episode's steps as :class:`~autoscale.training.StepRecord` (replayed: no wall time)."""
        done = self._episode_records  # built once per episode state (scorecard() reads them too)
        if done is not None and done[0] is self.records and done[1] == len(self.records):
            return list(done[2])
        if self._make_record is None:
            self._make_record = _record_maker()
        make, loss = self._make_record, self._cur[2]["loss"]  # the training loss of step i
        out = [make(s, p, loss[s.step]) for s, p in self.records]
        self._episode_records = (self.records, len(out), out)
        return list(out)

    def scorecard(self):
        """The episode's scorecard as replay predicts it (eval loss: the recording's)."""
        from autoscale.training import Scorecard

        return Scorecard.from_records(
            self.episode_records(),
            eval_loss=self._cur[0].eval_loss,
            hit_min=self.hit_min,
            wall_s=0.0,
        )
