"""Speed of the replay environment through ``gym.make``, the code before the fast path and now,
measured side by side in one run.

Both envs are made by ``gymnasium.make`` (the same wrappers: OrderEnforcing, PassiveEnvChecker)
over the same trace and stepped with the same actions, in interleaved blocks; the rate of each is
the median over blocks of steps per second of process CPU time on one core (wall time beside it:
this machine is shared). "Before" is :class:`ReferenceReplayEnv` below: the generic step path of
:class:`~autoscale.envs.base.ScaleEnvBase` (``step`` -> ``step_at`` -> ``_take`` ->
``_advance``) with the pre-change ``ReplayEnv._advance``, ``FeatureExtractor.features`` and
``ActionMap.delta`` kept here verbatim; "now" is ``ReplayEnv.step``. The run also checks that both
returned the same observations, rewards, flags and infos, step by step.

    python experiments/benchmarks/replay_speed.py [--env envs/gpt2-tiny.yaml] [--trace FILE] \
        [--steps 200000] [--blocks 9] [--out FILE]

The trace is recorded here (bf16 autocast on the CPU, ``episode.steps`` steps of the spec's first
train instance), or read from ``--trace`` if that file exists, and written there otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

import autoscale.envs  # noqa: F401  (registers the env ids)
from autoscale.envs import ReplayEnv
from autoscale.envs.replay_env import TABLE_HI, TABLE_LO
from autoscale.envs.replay_env import _make_stats as make_stats  # the old _advance's maker
from autoscale.errors import ConfigError
from autoscale.scalers.features import (
    FEATURE_BOUND,
    LOG2_FP16_MAX,
    LOG2_FP16_MIN_NORMAL,
    FeatureExtractor,
)
from autoscale.scalers.loss_guard import guarded_scale

REFERENCE_ID = "autoscale-bench/ReplayBefore-v0"


class ReferenceFeatures(FeatureExtractor):
    """The feature extractor with ``features`` as it was before the fast path (same values)."""

    def features(self, scale: float) -> list[float]:
        log2_scale = math.log2(scale)
        amax, rms, ema, loss = self.last_amax, self.last_rms, self.loss_ema, self.last_loss
        known = math.isfinite(amax)
        headroom = LOG2_FP16_MAX - (math.log2(amax) + log2_scale) if known else 0.0
        floor = (math.log2(rms) + log2_scale - LOG2_FP16_MIN_NORMAL) if math.isfinite(rms) else 0.0
        trend = 0.0
        if math.isfinite(ema) and math.isfinite(loss):
            trend = max(-1.0, min(1.0, math.log(loss) - math.log(ema)))
        n = max(1, len(self.overflows))
        b = FEATURE_BOUND
        return [
            max(-b, min(b, log2_scale / 16.0)),
            float(self.last_overflow),
            self._n_overflows / n,
            min(1.0, math.log2(1 + self.since_overflow) / 11.0),
            max(-b, min(b, headroom / 16.0)),
            max(-b, min(b, floor / 16.0)),
            float(known),
            float(self.last_nonfinite),
            self._n_nonfinite / n,
            trend,
            min(1.0, math.log2(1 + self.steps) / 16.0),
        ]


def reference_delta(action_map, action: Any) -> float:
    """``ActionMap.delta`` as it was before the fast path."""
    if action_map.mode == "discrete":
        index = int(
            action.item()
            if hasattr(action, "item")
            else (action[0] if isinstance(action, (list, tuple)) else action)
        )
        if not 0 <= index < len(action_map.deltas):
            raise ConfigError(
                f"discrete action {index} out of range 0..{len(action_map.deltas) - 1}"
            )
        return action_map.deltas[index]
    return action_map.delta(action)


class ReferenceReplayEnv(ReplayEnv):
    """``ReplayEnv`` stepped as before the fast path: ScaleEnvBase's generic step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.features = ReferenceFeatures()

    def step(self, action):
        if self.instance is None:
            raise RuntimeError("call reset() before step()")
        return self.step_at(self.scale * 2.0 ** reference_delta(self.action_map, action))

    def _advance(self, scale: float):
        """``ReplayEnv._advance`` as it was before the fast path (six lookups a step; the
        precision row now read from the step's row tuple)."""
        _, rows, cols = self._cur
        i = self._offset + self._t
        loss = cols["loss"][i]
        guarded = False
        if self.guard_rule is not None:
            step_scale = guarded_scale(scale, loss, self.guard_rule.guard_limit(), self.min_scale)
            scale, guarded = step_scale, step_scale < scale
        log2_scale = math.log2(scale)
        if cols["nonfinite"][i] or log2_scale > cols["threshold"][i]:
            stats = make_stats(i, scale, True, math.inf, math.inf, loss, True, guarded)
            precision = math.nan
        else:
            stats = make_stats(
                i, scale, False, cols["amax"][i], cols["rms"][i], loss, True, guarded
            )
            pos = min(max(log2_scale - TABLE_LO, 0.0), TABLE_HI - TABLE_LO)
            lo = int(pos)
            row = rows[i][5]
            frac = pos - lo
            precision = (
                row[lo]
                if frac == 0.0 or lo + 1 >= len(row)
                else row[lo] * (1 - frac) + row[lo + 1] * frac
            )
        self.records.append((stats, precision))
        return stats, precision, False


class Clocks:
    """Process CPU time and wall-clock time of a block, together."""

    def __enter__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall


def make_trace(spec, path: str | None):
    from autoscale.envs import Trace, record_trace

    names = {i.name for i in spec.instances["train"]}  # the env replays every train instance
    if path and os.path.exists(path):
        trace = Trace.load(path)
        if trace.spec.get("workload") == spec.workload.to_dict() and names <= set(trace.instances):
            return trace
    return record_trace(spec, spec.episode.steps, path, instances=("train",))


def block(env, actions: np.ndarray, keep: list | None) -> Clocks:
    """Step ``env`` through ``actions`` (resetting at episode ends); keep the returns if asked."""
    step, reset = env.step, env.reset
    with Clocks() as c:
        for a in actions.tolist():
            out = step(a)
            if keep is not None:
                keep.append(out)
            if out[2] or out[3]:
                reset()
    return c


def same(a: list, b: list) -> bool:
    """Step returns equal, bit for bit (NaNs equal; observations by value and dtype)."""
    for (oa, ra, ta, ua, ia), (ob, rb, tb, ub, ib) in zip(a, b, strict=True):
        if oa.dtype != ob.dtype or not np.array_equal(oa, ob, equal_nan=True):
            return False
        if repr((ra, ta, ua, ia)) != repr((rb, tb, ub, ib)):
            return False
    return True


def main(argv=None) -> int:
    import gymnasium as gym
    from gymnasium.envs.registration import register, registry

    from autoscale.envs import load_env_spec

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", default="envs/gpt2-tiny.yaml")
    p.add_argument("--trace", help="trace file (read, or written)")
    p.add_argument("--steps", type=int, default=200_000, help="steps per env in all")
    p.add_argument("--blocks", type=int, default=9, help="interleaved blocks per env")
    p.add_argument("--out", help="also write the results as markdown here")
    args = p.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    spec = load_env_spec(args.env)
    spec = dataclasses.replace(spec, workload=spec.workload.replace(dtype="bf16"))
    trace = make_trace(spec, args.trace)
    if REFERENCE_ID not in registry:
        register(id=REFERENCE_ID, entry_point=ReferenceReplayEnv, nondeterministic=True)
    envs = {
        "before": gym.make(REFERENCE_ID, spec=spec, trace=trace),
        "now": gym.make("autoscale/LossScaleReplay-v0", spec=spec, trace=trace),
    }
    n = envs["now"].action_space.n
    actions = np.random.default_rng(0).integers(n, size=args.steps // args.blocks)
    kept: dict[str, list] = {}
    for name, env in envs.items():  # warm, and the outputs compared
        env.reset(seed=0)
        block(env, actions, kept.setdefault(name, []))
    equal = same(kept["before"], kept["now"])
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in envs}
    for _ in range(args.blocks):
        for name, env in envs.items():
            c = block(env, actions, None)
            rates[name].append((len(actions) / c.cpu, len(actions) / c.wall))
    med = {k: [statistics.median(r[i] for r in v) for i in (0, 1)] for k, v in rates.items()}
    lines = [
        f"replay env through gym.make on {spec.name} ({spec.workload.model}), "
        f"{spec.episode.steps}-step episodes driven by random discrete actions, "
        f"{args.blocks} interleaved blocks of {len(actions):,} steps per env, medians",
        "",
        "Rates are steps per second of process CPU time on one core (wall-clock rate in "
        f"parentheses; load average {os.getloadavg()[0]:.1f} at the end of the run).",
        "",
        "| env | steps/s | target |",
        "|---|---|---|",
        f"| before (generic step path, features and action map as before) | "
        f"{med['before'][0]:,.0f} ({med['before'][1]:,.0f} wall) | |",
        f"| now (ReplayEnv.step) | {med['now'][0]:,.0f} ({med['now'][1]:,.0f} wall) | >= 150,000 |",
        "",
        f"now / before: {med['now'][0] / med['before'][0]:.2f}x (CPU), "
        f"{med['now'][1] / med['before'][1]:.2f}x (wall); "
        f"same observations, rewards, flags and infos on {len(actions):,} steps: "
        f"{'yes' if equal else 'NO'}",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            head = ["# Replay env speed", "", "`python " + " ".join(sys.argv) + "`", ""]
            fh.write("\n".join(head + lines) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
