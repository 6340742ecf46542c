"""Replay of parametric rules, scalar and vectorised, measured side by side in one run.

For each vectorised family (``autoscale.envs.vector_replay.VECTOR_RULES``: every built-in rule):
K candidates (random parameters over the search's ranges, the family's defaults first) on E
episodes of ``--horizon`` steps (windows of one recorded instance at E offsets), replayed

  * scalar: ``drive_episode`` with a fresh scaler per episode, as the search's bench does, for
    the first ``--scalar-candidates`` candidates (it is slow; its rate does not depend on K);
  * vectorised: ``replay_rule`` on all K x E lanes at once (scorecards included).

Rates are replayed steps (lane-steps) per second of process CPU time on one core; the wall-clock
rate is beside them. The run also checks that both gave equal scorecards, field by field, on the
candidates both replayed. Building the windows (once per bench) is timed apart.

    python experiments/benchmarks/vector_replay_speed.py [--horizon 2048] [--candidates 64] \
        [--episodes 8] [--trace FILE] [--out FILE]

The trace is ``--env``'s first train instance (fp16 on the CPU), ``2 x horizon`` steps, recorded
here, or read from ``--trace`` if that file exists, and written there otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np


class Clocks:
    """Process CPU time and wall-clock time of a block, together."""

    def __enter__(self):
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall


def long_spec(path: str, horizon: int):
    from autoscale.envs import load_env_spec

    spec = load_env_spec(path)
    return dataclasses.replace(  # one instance, long episodes
        spec,
        episode=dataclasses.replace(spec.episode, steps=horizon, horizon=horizon),
        instances={**spec.instances, "train": spec.instances["train"][:1]},
    )


def long_trace(spec, horizon: int, path: str | None):
    from autoscale.envs import Trace, record_trace

    inst = spec.instances["train"][0].name
    if path and os.path.exists(path):
        trace = Trace.load(path)
        same = trace.spec.get("workload") == spec.workload.to_dict()
        if same and inst in trace.instances and trace.instance(inst).steps >= 2 * horizon:
            return trace
    return record_trace(spec, 2 * horizon, path, instances=[inst])


def draws(rule: str, n: int, rng: np.random.Generator) -> list[dict]:
    """The defaults, then n - 1 random draws of the rule's searched knobs."""
    from autoscale.search.space import KNOBS, RULE_KNOBS, parametric_families

    knobs = {**KNOBS, **RULE_KNOBS.get(rule, {})}
    out: list[dict] = [{}]
    for _ in range(n - 1):
        params: dict = {}
        for knob in parametric_families()[rule]:
            k = knobs.get(knob)
            if k is None:
                continue
            if k.kind == "bool":
                params[knob] = bool(rng.random() < 0.5)
                continue
            lo, hi = (math.log(k.low), math.log(k.high)) if k.log else (k.low, k.high)
            x = float(rng.uniform(lo, hi))
            x = math.exp(x) if k.log else x
            if k.kind == "log2":  # an exponent: the value is 2**k
                params[knob] = 2.0 ** int(round(x))
            else:
                params[knob] = int(round(x)) if k.kind == "int" else x
        out.append(params)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--env", default="envs/mlp-bad-batches.yaml")
    p.add_argument("--horizon", type=int, default=2048)
    p.add_argument("--candidates", type=int, default=64, help="K: candidates per family")
    p.add_argument("--episodes", type=int, default=8, help="E: windows of the trace")
    p.add_argument("--scalar-candidates", type=int, default=2, help="replayed scalar too")
    p.add_argument("--trace", help="trace file (read, or written)")
    p.add_argument("--out", help="also write the results as markdown here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    from autoscale.envs import ReplayEnv
    from autoscale.envs.episodes import drive_episode, scaler_for
    from autoscale.envs.vector_replay import VECTOR_RULES, replay_rule, replay_windows

    h = args.horizon
    spec = long_spec(args.env, h)
    trace = long_trace(spec, h, args.trace)
    env = ReplayEnv(spec, trace, instances="train")
    inst = spec.instances["train"][0].name
    last = trace.instance(inst).steps - h
    episodes = [(inst, round(last * j / max(1, args.episodes - 1))) for j in range(args.episodes)]
    with Clocks() as built:
        windows = replay_windows(env, episodes)
    rng = np.random.default_rng(0)
    rows, all_equal = [], True
    for rule in sorted(VECTOR_RULES):
        params = draws(rule, args.candidates, rng)
        with Clocks() as vec:
            cards = replay_rule(rule, [scaler_for(rule, spec, **kw) for kw in params], windows)
        lane_steps = sum(c.steps for row in cards for c in row)
        scalar_steps, equal = 0, True
        with Clocks() as sc:
            for k, kw in enumerate(params[: args.scalar_candidates]):
                for e, (name, offset) in enumerate(episodes):
                    card, _ = drive_episode(env, scaler_for(rule, spec, **kw), name, offset)
                    scalar_steps += card.steps
                    equal &= repr(card.to_dict()) == repr(cards[k][e].to_dict())
        all_equal &= equal
        s_cpu, v_cpu = scalar_steps / sc.cpu, lane_steps / vec.cpu
        rows.append(
            f"| {rule} | {s_cpu:,.0f} ({scalar_steps / sc.wall:,.0f} wall) "
            f"| {v_cpu:,.0f} ({lane_steps / vec.wall:,.0f} wall) | {v_cpu / s_cpu:.1f}x "
            f"| {'yes' if equal else 'NO'} |"
        )
    lines = [
        f"replay of {spec.name} ({spec.workload.model}, {spec.workload.dtype}): {h}-step "
        f"episodes, E = {len(episodes)} windows of one instance, K = {args.candidates} "
        f"candidates per family (scalar: the first {args.scalar_candidates})",
        "",
        "Rates are replayed steps per second of process CPU time on one core (wall-clock rate "
        f"in parentheses; load average {os.getloadavg()[0]:.1f} at the end of the run). "
        f"Building the {len(episodes)} windows took {built.cpu:.2f} s CPU, once per bench.",
        "",
        "| family | scalar steps/s | vectorised lane-steps/s (target >= 1,000,000) | ratio "
        "| same scorecards |",
        "|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            head = ["# Vectorised replay speed", "", "`python " + " ".join(sys.argv) + "`", ""]
            fh.write("\n".join(head + lines) + "\n")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
