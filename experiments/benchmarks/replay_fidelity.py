"""How faithfully the replay env predicts real steps over long episodes.

For each (workload, scenario) pair: record a trace of the test instances (the recording rule,
``amax-history`` with 2 bits of margin, drives it), then run every built-in rule, a few eagerly
tuned rules and a seeded random policy for ``--steps`` steps on the real env and on the replay of
the same instances, and compare skip rate and precision loss (target: within 20%).

    python experiments/benchmarks/replay_fidelity.py [--steps 1024] [--instances 2] \
        [--workloads mlp autoencoder] [--gpt2] [--scenarios clean bad-batches ...] \
        [--out experiments/results/replay_fidelity.md]
    python experiments/benchmarks/replay_fidelity.py --policies PATH ... --only-policies \
        --out experiments/results/replay_fidelity_scale_time.md

``--policies`` adds exported policies (agents that act at scale time read the recorded loss in
replay and the real one on real steps); ``--only-policies`` judges them with ``torch``,
``amax-loss`` (whose guard reads the loss too) and a seeded random policy acting at scale time
(deltas of -2..+2 bits or drops of 4..16 bits for one step) instead of every rule.

Replay keeps the recorded trajectory whatever the policy does. A real run that skips steps the
recording did not (or loses precision differently) takes other optimizer steps, so its parameters
and hence its later gradients and overflow thresholds differ from the trace. The report measures
that drift: the gap over the first ``--prefix`` steps against the whole episode, the step where
each real run's loss first departs from the recorded loss, and how the gap goes with the number of
steps the policy skipped that the recording did not.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import numpy as np

from autoscale.scalers import LossScaler, ScaleRule, StepStats

WORKLOADS = {
    "mlp": {"model": "mlp", "batch_size": 32},
    "autoencoder": {"model": "autoencoder", "batch_size": 32},
    "gpt2-tiny": {"model": "gpt2-tiny", "batch_size": 4, "seq_len": 64},
}
SCENARIOS = {
    "clean": {"warmup": 100, "decay": 1000},
    "bad-batches": {"every": 8},
    "small-grads": {"weight": 1.0e-5},
    "moving": {"at": 150, "width": 30, "peak": 4096.0, "period": 300},
}
# Eagerly tuned rules: the knobs a search on short replayed episodes found (growing every 14-33
# steps), which are the ones whose real runs leave the recorded trajectory most.
TUNED = {
    "torch-gi20": ("torch", {"growth_interval": 20}),
    "megatron-tuned": (
        "megatron",
        {"growth_interval": 33, "growth_factor": 1.3, "backoff_factor": 0.094, "hysteresis": 2},
    ),
    "fairseq-tuned": ("fairseq", {"scale_window": 14, "scale_factor": 7.0, "tolerance": 0.32}),
    "amax-history-tuned": (
        "amax-history",
        {"history_len": 1, "margin": 4.38, "backoff_factor": 0.88},
    ),
}
METRICS = ("skip_rate", "precision_loss")
REL_TARGET = 0.2
ABS_TOL = 0.002  # 2 steps in 1000, or 0.2 points of precision loss


class RandomDeltaRule(ScaleRule):
    """A seeded random policy: each step moves log2(scale) by one of -2..+2 bits."""

    name = "random"

    def __init__(self, *, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return scale * 2.0 ** self.rng.choice((-2, -1, 0, 1, 2))


class RandomNowRule(ScaleRule):
    """A seeded random policy acting at scale time: each step takes a delta of -2..+2 bits that
    carries on, or a drop of 4, 8, 12 or 16 bits for that step only (as a scale-time agent's
    discrete actions), chosen when the loss is scaled."""

    name = "random-now"
    has_guard = True
    scale_time = True
    needs_loss = True

    def __init__(self, *, seed: int = 0) -> None:
        from autoscale.scalers.actions import ActionMap

        self.rng = random.Random(seed)
        self.action = ActionMap(drops=(4.0, 8.0, 12.0, 16.0))
        self.base = math.nan

    def step_scale(self, scale: float, loss: float, bounds) -> float:
        return bounds.clamp(scale * 2.0 ** self.action.delta(self.rng.randrange(self.action.n)))

    def adopt(self, scale: float) -> None:
        self.base = scale

    def next_scale(self, scale: float, stats: StepStats) -> float:
        return self.action.base_after(stats.scale, self.base if self.base == self.base else scale)


def rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def verdict(a: float, b: float) -> str:
    """``yes`` within 20% relative, ``abs`` when only the absolute difference is small."""
    d = rel(a, b)
    if d <= REL_TARGET:
        return "yes"
    if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= ABS_TOL:
        return "abs"
    return "NO"


def suite_dict(workloads: list[str], scenarios: list[str], steps: int, instances: int) -> dict:
    return {
        "name": "fidelity",
        "workload": {"dtype": "fp16", "lr": 0.001},
        "suite": {
            "workloads": {w: WORKLOADS[w] for w in workloads},
            "scenarios": {s: SCENARIOS[s] for s in scenarios},
        },
        "episode": {
            "steps": steps,
            "horizon": steps,
            "action": {"mode": "discrete", "deltas": [-2, -1, 0, 1, 2]},
            "init_scale": 65536,
            "min_scale": 1.0,
            "max_scale": "2**40",
        },
        "instances": {
            "train": [{"seed": 0}],
            "test": [{"seed": 100 + k} for k in range(instances)],
        },
    }


def factories(spec, policies: tuple[str, ...] = (), only_policies: bool = False) -> dict:
    from pathlib import Path

    from autoscale.envs.episodes import scaler_for
    from autoscale.scalers import list_scalers

    ep = spec.episode
    bounds = ep.scale_kwargs()
    if only_policies:
        out = {n: (lambda n=n: scaler_for(n, spec)) for n in ("torch", "amax-loss")}
        out["random-now"] = lambda: LossScaler(RandomNowRule(seed=1), "cpu", **bounds)
    else:
        out = {
            i.name: (lambda n=i.name: scaler_for(n, spec))
            for i in list_scalers()
            if i.kind == "rule"
        }
        for name, (base, kw) in TUNED.items():
            out[name] = lambda b=base, k=kw: scaler_for(b, spec, **k)
        out["random"] = lambda: LossScaler(RandomDeltaRule(seed=1), "cpu", **bounds)
    for path in policies:
        out[Path(path).name] = lambda p=path: scaler_for(p, spec)
    return out


def window(records: list, n: int) -> dict[str, float]:
    """Skip rate and precision loss of the first ``n`` steps, as the scorecard defines them."""
    from autoscale.training import Scorecard

    card = Scorecard.from_records(records[:n], eval_loss=math.nan, hit_min=False, wall_s=0.0)
    return {m: getattr(card, m) for m in METRICS}


def same_loss(a: float, b: float) -> bool:
    return a == b or not (math.isfinite(a) or math.isfinite(b))


def first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


CAUSES = {
    "skip": "a skip the recording did not have (or the reverse): an update left out or added",
    "odd scale": "a scale that is not a power of two: every scaled fp16 value rounds otherwise",
    "scale": "another power-of-two scale: other gradient elements flushed below fp16's range",
}


def episode_facts(real: list, replay: list, traced, checkpoints: list[int]) -> dict:
    """Per-episode comparison of the real run, its replay and the recording it replays.

    The real run follows the recorded trajectory exactly (bit for bit: the same losses) until a
    step updates the parameters otherwise than the recording did. ``cause`` names the latest
    event kind that first happened before the departure (see :data:`CAUSES`).
    """
    n = len(real)
    rec_skip = (traced.nonfinite | (np.log2(traced.scale) > traced.threshold))[:n]
    real_skip = np.array([r.found_inf for r in real])
    replay_skip = np.array([r.found_inf for r in replay[:n]])
    scales = np.array([r.scale for r in real])
    depart = next((i for i, r in enumerate(real) if not same_loss(r.loss, traced.loss[i])), None)
    events = {
        "skip": first(real_skip != rec_skip),
        "odd scale": first(np.array([math.frexp(x)[0] != 0.5 for x in scales]) & ~real_skip),
        "scale": first((scales != traced.scale[:n]) & ~real_skip),
    }
    cause = None
    if depart is not None:
        before = {k: v for k, v in events.items() if v is not None and v < depart}
        cause = max(before, key=lambda k: before[k]) if before else "unknown"
    return {
        "steps": n,
        "real": {str(c): window(real, c) for c in checkpoints},
        "replay": {str(c): window(replay, c) for c in checkpoints},
        "recording_skipped": int(rec_skip.sum()),
        "real_skipped": int(real_skip.sum()),
        "extra_skips": int((real_skip & ~rec_skip).sum()),  # skipped for real, not when recorded
        "missing_skips": int((rec_skip & ~real_skip).sum()),  # skipped when recorded, not for real
        "skip_disagreements": int((real_skip != replay_skip).sum()),  # real against its replay
        "first_events": events,
        "departs_at": depart,  # first step whose real loss differs from the recorded one
        "cause": cause,
    }


def run_member(
    member, steps: int, checkpoints: list[int], log, policies=(), only_policies=False
) -> list[dict]:
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.envs import record_trace

    t0 = time.perf_counter()
    trace = record_trace(member, steps, None, instances=("test",))
    log(
        f"{member.name}: recorded {steps} steps x {len(member.instances['test'])} instances "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    made = factories(member, tuple(policies), only_policies)
    t0 = time.perf_counter()
    _, replay_recs = evaluate_scalers(member, made, trace=trace, keep_records=True)
    t1 = time.perf_counter()
    _, real_recs = evaluate_scalers(member, made, keep_records=True)
    log(f"{member.name}: replay {t1 - t0:.1f} s, real {time.perf_counter() - t1:.0f} s")
    workload, scenario = member.name.split("/")
    out = []
    for name in made:
        for k, inst in enumerate(member.instances["test"]):
            facts = episode_facts(
                real_recs[name][k], replay_recs[name][k], trace.instance(inst.name), checkpoints
            )
            out.append(
                {
                    "workload": workload,
                    "scenario": scenario,
                    "scaler": name,
                    "instance": inst.name,
                    **facts,
                }
            )
    return out


def mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def rows_of(episodes: list[dict], horizon: int, prefix: int) -> list[dict]:
    """One row per (workload, scenario, scaler, metric): means over the instances."""
    groups: dict[tuple, list[dict]] = {}
    for e in episodes:
        groups.setdefault((e["workload"], e["scenario"], e["scaler"]), []).append(e)
    rows = []
    for (w, s, name), eps in groups.items():
        departs = [e["departs_at"] for e in eps]
        for m in METRICS:
            row = {"workload": w, "scenario": s, "scaler": name, "metric": m}
            for c in (prefix, horizon):
                r = mean(e["real"][str(c)][m] for e in eps)
                p = mean(e["replay"][str(c)][m] for e in eps)
                row[f"real_{c}"], row[f"replay_{c}"] = r, p
                row[f"abs_{c}"], row[f"rel_{c}"], row[f"ok_{c}"] = (
                    abs(r - p),
                    rel(r, p),
                    verdict(r, p),
                )
            row["extra_skips"] = mean(e["extra_skips"] for e in eps)
            row["skip_disagreements"] = mean(e["skip_disagreements"] for e in eps)
            row["causes"] = sorted({e["cause"] for e in eps if e["cause"]})
            row["departs_at"] = min((d for d in departs if d is not None), default=None)
            row["departed"] = sum(d is not None for d in departs)
            row["instances"] = len(eps)
            row["why"] = why(row, horizon) if row[f"ok_{horizon}"] != "yes" else ""
            rows.append(row)
    return rows


def why(row: dict, horizon: int) -> str:
    """Where the gap comes from, read off the episode facts."""
    if not row["departed"]:
        if row["metric"] == "precision_loss":
            return "same trajectory as the recording: replay's 1-bit histogram interpolation"
        return "same trajectory as the recording"
    causes = " / ".join(row["causes"])
    return (
        f"leaves the recorded trajectory at step {row['departs_at']} ({causes}); "
        f"{row['extra_skips']:.0f} skips per episode the recording did not have; real and "
        f"replay disagree on {row['skip_disagreements']:.0f} skips"
    )


def growth(episodes: list[dict], checkpoints: list[int]) -> list[dict]:
    """How the gap grows with the horizon: mean absolute gap over the first c steps."""
    out = []
    for c in checkpoints:
        key = str(c)
        d = {m: [abs(e["real"][key][m] - e["replay"][key][m]) for e in episodes] for m in METRICS}
        out.append(
            {
                "steps": c,
                **{f"mean_abs_{m}": mean(d[m]) for m in METRICS},
                **{
                    f"max_abs_{m}": max((x for x in d[m] if math.isfinite(x)), default=math.nan)
                    for m in METRICS
                },
                "departed": sum(
                    e["departs_at"] is not None and e["departs_at"] < c for e in episodes
                ),
                "episodes": len(episodes),
            }
        )
    return out


def by_cause(episodes: list[dict], checkpoints: list[int]) -> list[dict]:
    """Mean absolute gaps of the episodes grouped by what made them leave the trajectory."""
    out = []
    for cause in [None, *CAUSES, "unknown"]:
        eps = [e for e in episodes if e["cause"] == cause]
        if not eps:
            continue
        row = {"cause": cause or "never left", "episodes": len(eps)}
        row["departs_median"] = (
            float(np.median([e["departs_at"] for e in eps])) if cause else math.nan
        )
        for c in (checkpoints[0], checkpoints[-1]):
            for m in METRICS:
                row[f"{m}_{c}"] = mean(
                    abs(e["real"][str(c)][m] - e["replay"][str(c)][m]) for e in eps
                )
        out.append(row)
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # average ties
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def _corr(x: np.ndarray, y: np.ndarray) -> dict:
    """Pearson and Spearman correlation (NaN where either side is constant)."""
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return {"pearson": math.nan, "spearman": math.nan, "n": int(len(x))}
    return {
        "pearson": float(np.corrcoef(x, y)[0, 1]),
        "spearman": float(np.corrcoef(_ranks(x), _ranks(y))[0, 1]),
        "n": int(len(x)),
    }


def correlation(episodes: list[dict], horizon: int) -> dict:
    """Correlation, over episodes, of the extra skips (per step) with the absolute real-replay gap
    of each metric over the whole episode, and with the steps where real and replay disagree on
    skipping; the mean gaps of episodes that did and did not leave the recorded trajectory."""
    key = str(horizon)
    extra = np.array([e["extra_skips"] / e["steps"] for e in episodes], dtype=float)
    out = {}
    for m in METRICS:
        gap = np.array([abs(e["real"][key][m] - e["replay"][key][m]) for e in episodes])
        ok = np.isfinite(gap)
        out[m] = _corr(extra[ok], gap[ok])
    disagree = np.array([e["skip_disagreements"] / e["steps"] for e in episodes], dtype=float)
    out["skip_disagreements"] = _corr(extra, disagree)
    still = [e for e in episodes if e["departs_at"] is None]
    moved = [e for e in episodes if e["departs_at"] is not None]
    for label, eps in (("undeparted", still), ("departed", moved)):
        out[label] = {
            "episodes": len(eps),
            **{
                f"mean_abs_{m}": mean(abs(e["real"][key][m] - e["replay"][key][m]) for e in eps)
                for m in METRICS
            },
        }
    return out


EXTRA_BINS = ((0, 0), (1, 10), (11, 100), (101, 10**9))


def by_extra(episodes: list[dict], horizon: int) -> list[dict]:
    """Mean absolute gaps over the whole episode, by how many steps the real run skipped that the
    recording did not."""
    key = str(horizon)
    out = []
    for lo, hi in EXTRA_BINS:
        eps = [e for e in episodes if lo <= e["extra_skips"] <= hi]
        if not eps:
            continue
        out.append(
            {
                "extra_skips": f"{lo}" if lo == hi else f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}",
                "episodes": len(eps),
                **{
                    f"mean_abs_{m}": mean(abs(e["real"][key][m] - e["replay"][key][m]) for e in eps)
                    for m in METRICS
                },
                "skip_disagreements": mean(e["skip_disagreements"] for e in eps),
            }
        )
    return out


def fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4f}"


def pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def key_cells(row: dict) -> list[str]:
    return [row["workload"], row["scenario"], row["scaler"], row["metric"]]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def report(args, episodes, rows, grow, corr, causes, extra, horizon, prefix, wall) -> list[str]:
    lines = [
        f"Episodes of {horizon} real fp16 steps (CPU, 1 thread) against the replay of a trace "
        f"recorded on the same test instances ({args.instances} per pair, seeds 100..), for "
        f"{len({e['scaler'] for e in episodes})} scalers: "
        + (
            "`torch`, `amax-loss` (its guard reads each step's loss), a seeded random policy "
            "acting at scale time (`random-now`: a delta of -2..+2 bits or a drop of 4..16 bits "
            "for one step) and the exported policies "
            + ", ".join(
                f"`{n}`"
                for n in sorted({e["scaler"] for e in episodes})
                if n not in ("torch", "amax-loss", "random-now")
            )  # fmt: skip
            if getattr(args, "only_policies", False)
            else "every built-in rule, the tuned rules "
            + ", ".join(f"`{n}` ({b} {k})" for n, (b, k) in TUNED.items())
            + ", and a seeded random policy (+-2 bits per step)"
        )
        + ". Workloads "
        + ", ".join(args.workloads)
        + "; scenarios "
        + ", ".join(f"{s} {SCENARIOS[s]}" for s in args.scenarios)
        + f". {len(episodes)} episodes; wall time {wall / 60:.1f} min.",
        "",
        (
            "Agents acting at scale time read each step's loss: replay gives them the recorded "
            "loss, real steps the loss of their own trajectory, which differs once it has left "
            "the recorded one (below); so does what their decisions see."
            if getattr(args, "only_policies", False)
            else "This replaces the earlier table of 64-step gpt2-tiny episodes (bad-batches and "
            "small-grads; in git history): the short horizon is now the first "
            f"{prefix} steps of each episode. `--gpt2` adds gpt2-tiny (hours of fp16 steps on a "
            "CPU)."
        ),
        "",
        f"Verdict: `yes` within 20% relative; `abs` off by more than 20% relative but at most "
        f"{ABS_TOL} absolute; `NO` otherwise. Values are means over the instances.",
        "",
    ]
    for c in (prefix, horizon):
        n = len(rows)
        yes = sum(r[f"ok_{c}"] == "yes" for r in rows)
        small = sum(r[f"ok_{c}"] == "abs" for r in rows)
        lines.append(
            f"- first {c} steps: {yes} of {n} comparisons within 20% relative, {small} more within "
            f"{ABS_TOL} absolute, {n - yes - small} off."
        )
    off = [r for r in rows if r[f"ok_{horizon}"] == "NO"]
    if off:
        lines += ["", f"## Where it drifts over {horizon} steps (verdict NO)", ""]
        lines += table(
            [
                "workload",
                "scenario",
                "scaler",
                "metric",
                f"real {prefix}",
                f"replay {prefix}",
                "real",
                "replay",
                "abs.",
                "rel.",
                "why",
            ],
            [
                [
                    *key_cells(r),
                    fmt(r[f"real_{prefix}"]),
                    fmt(r[f"replay_{prefix}"]),
                    fmt(r[f"real_{horizon}"]),
                    fmt(r[f"replay_{horizon}"]),
                    fmt(r[f"abs_{horizon}"]),
                    pct(r[f"rel_{horizon}"]),
                    r["why"],
                ]
                for r in off
            ],
        )
    lines += [
        "",
        "## Why: real runs leave the recorded trajectory",
        "",
        "Replay keeps the recorded trajectory whatever the policy does. A real run reproduces the "
        "recording bit for bit (the same losses) as long as each of its steps updates the "
        "parameters exactly as the recording did; scaling by a power of two changes no fp16 "
        "rounding, so only these break it: "
        + "; ".join(f"**{k}**: {v}" for k, v in CAUSES.items())
        + ". From then on the real run has other parameters, hence other gradients and other "
        "overflow thresholds than the ones replay reads from the trace. Episodes by the latest "
        "of these events to first happen before the real loss first differs from the recorded "
        "one, with the mean absolute real-replay gap:",
        "",
    ]
    c0, c1 = prefix, horizon
    lines += table(
        [
            "left the trajectory by",
            "episodes",
            "median step it left",
            f"skip rate gap, {c0} steps",
            f"{c1} steps",
            f"precision loss gap, {c0} steps",
            f"{c1} steps",
        ],
        [
            [
                c["cause"],
                str(c["episodes"]),
                "-" if not math.isfinite(c["departs_median"]) else f"{c['departs_median']:.0f}",
                fmt(c[f"skip_rate_{c0}"]),
                fmt(c[f"skip_rate_{c1}"]),
                fmt(c[f"precision_loss_{c0}"]),
                fmt(c[f"precision_loss_{c1}"]),
            ]
            for c in causes
        ],
    )
    lines += ["", "## Gap against the horizon", ""]
    lines += table(
        [
            "steps",
            "mean abs. gap skip rate",
            "max",
            "mean abs. gap precision loss",
            "max",
            "episodes departed by then",
        ],
        [
            [
                str(g["steps"]),
                fmt(g["mean_abs_skip_rate"]),
                fmt(g["max_abs_skip_rate"]),
                fmt(g["mean_abs_precision_loss"]),
                fmt(g["max_abs_precision_loss"]),
                f"{g['departed']} of {g['episodes']}",
            ]
            for g in grow
        ],
    )
    lines += ["", "## Gap against extra skips", ""]
    lines.append(
        f"Extra skips: steps of the {horizon} the real run skipped that the recording did not. "
        "Skip disagreements: steps where the real run and its replay disagree on skipping."
    )
    lines.append("")
    lines += table(
        [
            "extra skips",
            "episodes",
            "mean abs. gap skip rate",
            "mean abs. gap precision loss",
            "skip disagreements",
        ],
        [
            [
                b["extra_skips"],
                str(b["episodes"]),
                fmt(b["mean_abs_skip_rate"]),
                fmt(b["mean_abs_precision_loss"]),
                f"{b['skip_disagreements']:.1f}",
            ]
            for b in extra
        ],
    )
    lines.append("")
    lines.append(
        f"Correlation over the {corr['skip_rate']['n']} episodes of extra skips per step with the "
        f"absolute gap over {horizon} steps: skip rate Pearson {corr['skip_rate']['pearson']:.2f}, "
        f"Spearman {corr['skip_rate']['spearman']:.2f}; precision loss Pearson "
        f"{corr['precision_loss']['pearson']:.2f}, Spearman {corr['precision_loss']['spearman']:.2f}; "
        f"skip disagreements per step Pearson {corr['skip_disagreements']['pearson']:.2f}, Spearman "
        f"{corr['skip_disagreements']['spearman']:.2f}."
    )
    u, d = corr["undeparted"], corr["departed"]
    lines.append(
        f"Episodes whose real run never left the recorded trajectory ({u['episodes']}): mean abs. "
        f"gap skip rate {fmt(u['mean_abs_skip_rate'])}, precision loss "
        f"{fmt(u['mean_abs_precision_loss'])} (replay's histogram interpolation alone). Episodes "
        f"that left it ({d['episodes']}): {fmt(d['mean_abs_skip_rate'])} and "
        f"{fmt(d['mean_abs_precision_loss'])}."
    )
    lines += ["", "## Per scaler", ""]
    lines.append(
        "`extra skips`: mean per episode; `disagree`: steps per episode where real and replay "
        "disagree on skipping; `departs at`: first step (over the instances) whose real loss "
        "differs from the recorded one, and in how many instances (`-`: never); `cause`: see above."
    )
    lines.append("")
    lines += table(
        [
            "workload",
            "scenario",
            "scaler",
            "metric",
            f"real {prefix}",
            f"replay {prefix}",
            f"rel. {prefix}",
            f"real {horizon}",
            f"replay {horizon}",
            f"abs. {horizon}",
            f"rel. {horizon}",
            "verdict",
            "extra skips",
            "disagree",
            "departs at",
            "cause",
        ],
        [
            [
                *key_cells(r),
                fmt(r[f"real_{prefix}"]),
                fmt(r[f"replay_{prefix}"]),
                pct(r[f"rel_{prefix}"]),
                fmt(r[f"real_{horizon}"]),
                fmt(r[f"replay_{horizon}"]),
                fmt(r[f"abs_{horizon}"]),
                pct(r[f"rel_{horizon}"]),
                r[f"ok_{horizon}"],
                f"{r['extra_skips']:.1f}",
                f"{r['skip_disagreements']:.1f}",
                "-"
                if r["departs_at"] is None
                else f"{r['departs_at']} ({r['departed']}/{r['instances']})",
                " / ".join(r["causes"]) or "-",
            ]
            for r in rows
        ],
    )
    return lines


def load_run(path: str) -> dict:
    """A previous run's data (``--out``'s .json), NaN restored where JSON holds null."""
    with open(path) as fh:
        data = json.load(fh)
    for e in data["episodes"]:
        for side in ("real", "replay"):
            for window_metrics in e[side].values():
                for m in METRICS:
                    if window_metrics[m] is None:
                        window_metrics[m] = math.nan
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workloads", nargs="+", default=["mlp", "autoencoder"], choices=list(WORKLOADS)
    )
    p.add_argument("--gpt2", action="store_true", help="also gpt2-tiny (slow on a CPU)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--steps", type=int, default=1024, help="episode length (default 1024)")
    p.add_argument("--prefix", type=int, default=128, help="short horizon compared (default 128)")
    p.add_argument("--instances", type=int, default=2, help="test instances per pair (default 2)")
    p.add_argument("--out", help="write the report as markdown here (and the data as .json)")
    p.add_argument(
        "--from-json", help="render the report from a previous run's .json instead of running"
    )
    p.add_argument("--policies", nargs="+", default=[], help="exported policies (paths) to add")
    p.add_argument(
        "--only-policies",
        action="store_true",
        help="judge --policies with torch, amax-loss and random-now only, not every rule",
    )
    args = p.parse_args(argv)
    if args.gpt2 and "gpt2-tiny" not in args.workloads:
        args.workloads.append("gpt2-tiny")
    if not 0 < args.prefix <= args.steps:
        p.error(f"--prefix must be in 1..--steps ({args.steps}), got {args.prefix}")
    command = "python " + " ".join(sys.argv)
    header = f"`{command}`"
    if args.from_json:
        data = load_run(args.from_json)
        episodes, wall, suite_data = data["episodes"], data["wall_s"], data["suite"]
        checkpoints = sorted(int(c) for c in episodes[0]["real"])
        args.prefix, args.steps = checkpoints[0], checkpoints[-1]
        args.workloads = list(dict.fromkeys(e["workload"] for e in episodes))
        args.scenarios = list(dict.fromkeys(e["scenario"] for e in episodes))
        first = (episodes[0]["workload"], episodes[0]["scenario"], episodes[0]["scaler"])
        args.instances = sum((e["workload"], e["scenario"], e["scaler"]) == first for e in episodes)
        header = f"`{data['command']}` (this report rendered from its data by `{command}`)"
        args.only_policies = data.get("only_policies", False)
    else:
        import torch

        from autoscale.envs.suite import SuiteSpec

        torch.set_num_threads(1)
        suite = SuiteSpec.from_dict(
            suite_dict(args.workloads, args.scenarios, args.steps, args.instances)
        )
        suite_data = suite.to_dict()
        checkpoints = sorted({args.prefix, *(c for c in (256, 512) if c < args.steps), args.steps})

        def log(msg: str) -> None:
            print(msg, file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        episodes = []
        for member in suite.members:
            episodes.extend(
                run_member(member, args.steps, checkpoints, log, args.policies, args.only_policies)
            )
        wall = time.perf_counter() - t0
    rows = rows_of(episodes, args.steps, args.prefix)
    grow = growth(episodes, checkpoints)
    corr = correlation(episodes, args.steps)
    causes = by_cause(episodes, checkpoints)
    extra = by_extra(episodes, args.steps)
    lines = report(args, episodes, rows, grow, corr, causes, extra, args.steps, args.prefix, wall)
    print("\n".join(lines))
    if args.out:
        from autoscale.training.scorecard import json_safe

        with open(args.out, "w") as fh:
            fh.write(
                f"# Replay fidelity at long horizons\n\n{header}\n\n" + "\n".join(lines) + "\n"
            )
        data = {
            "command": command if not args.from_json else data["command"],
            "suite": suite_data,
            "tuned": TUNED,
            "only_policies": args.only_policies,
            "rows": rows,
            "growth": grow,
            "correlation": corr,
            "causes": causes,
            "by_extra_skips": extra,
            "episodes": episodes,
            "wall_s": wall,
        }
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as fh:
            json.dump(json_safe(data), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
