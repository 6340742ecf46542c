"""How faithfully the replay env predicts real steps over long episodes.

For each (workload, scenario) pair: record a trace of the test instances (the recording rule,
``amax-history`` with 2 bits of margin, drives it), then run every built-in rule, a few eagerly
tuned rules and a seeded random policy for ``--steps`` steps on the real env and on the replay of
the same instances, and compare skip rate and precision loss (target: within 20%).

    python experiments/benchmarks/replay_fidelity.py [--steps 1024] [--instances 2] \
        [--workloads mlp autoencoder] [--gpt2] [--scenarios clean bad-batches ...] \
        [--out experiments/results/replay_fidelity.md]

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


def factories(spec) -> dict:
    from autoscale.agents.evaluate import scaler_for
    from autoscale.scalers import list_scalers

    out = {
        i.name: (lambda n=i.name: scaler_for(n, spec)) for i in list_scalers() if i.kind == "rule"
    }
    for name, (base, kw) in TUNED.items():
        out[name] = lambda b=base, k=kw: scaler_for(b, spec, **k)
    ep = spec.episode
    out["random"] = lambda: LossScaler(
        RandomDeltaRule(seed=1),
        "cpu",
        init_scale=ep.init_scale,
        min_scale=ep.min_scale,
        max_scale=ep.max_scale,
    )
    return out


def window(records: list, n: int) -> dict[str, float]:
    """Skip rate and precision loss of the first ``n`` steps, as the scorecard defines them."""
    from autoscale.training import Scorecard

    card = Scorecard.from_records(records[:n], eval_loss=math.nan, hit_min=False, wall_s=0.0)
    return {m: getattr(card, m) for m in METRICS}


def same_loss(a: float, b: float) -> bool:
    return a == b or not (math.isfinite(a) or math.isfinite(b))


def episode_facts(real: list, replay: list, traced, checkpoints: list[int]) -> dict:
    """Per-episode comparison of the real run, its replay and the recording it replays."""
    rec_skip = traced.nonfinite | (np.log2(traced.scale) > traced.threshold)
    n = len(real)
    real_skip = np.array([r.found_inf for r in real])
    depart = next((i for i, r in enumerate(real) if not same_loss(r.loss, traced.loss[i])), None)
    extra = real_skip & ~rec_skip[:n]
    return {
        "steps": n,
        "real": {str(c): window(real, c) for c in checkpoints},
        "replay": {str(c): window(replay, c) for c in checkpoints},
        "recording_skipped": int(rec_skip[:n].sum()),
        "real_skipped": int(real_skip.sum()),
        "extra_skips": int(extra.sum()),  # skipped in the real run, not in the recording
        "first_extra_skip": int(np.argmax(extra)) if extra.any() else None,
        "departs_at": depart,  # first step whose real loss differs from the recorded one
        "scale_below_recording": int(
            sum(r.scale < s for r, s in zip(real, traced.scale[:n], strict=True))
        ),
    }


def run_member(member, steps: int, checkpoints: list[int], log) -> list[dict]:
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.envs import record_trace

    t0 = time.perf_counter()
    trace = record_trace(member, steps, None, instances=("test",))
    log(
        f"{member.name}: recorded {steps} steps x {len(member.instances['test'])} instances "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    made = factories(member)
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
    lead = f"real run leaves the recorded trajectory at step {row['departs_at']}"
    if row["extra_skips"] >= 1:
        return (
            f"{lead}; it skipped {row['extra_skips']:.1f} steps per episode the recording did not"
        )
    return f"{lead} (other scales than the recording's: flushed gradients change the update)"


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


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # average ties
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def correlation(episodes: list[dict], horizon: int) -> dict:
    """Pearson and Spearman correlation, over episodes, of the extra skips (per step) with the
    absolute real-replay gap of each metric over the whole episode."""
    key = str(horizon)
    extra = np.array([e["extra_skips"] / e["steps"] for e in episodes], dtype=float)
    out = {}
    for m in METRICS:
        gap = np.array([abs(e["real"][key][m] - e["replay"][key][m]) for e in episodes])
        ok = np.isfinite(gap)
        x, y = extra[ok], gap[ok]
        if len(x) < 3 or x.std() == 0 or y.std() == 0:
            out[m] = {"pearson": math.nan, "spearman": math.nan, "n": int(len(x))}
            continue
        out[m] = {
            "pearson": float(np.corrcoef(x, y)[0, 1]),
            "spearman": float(np.corrcoef(_ranks(x), _ranks(y))[0, 1]),
            "n": int(len(x)),
        }
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


def fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4f}"


def pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.0%}"


def report(args, episodes, rows, grow, corr, horizon, prefix, wall) -> list[str]:
    lines = [
        f"Episodes of {horizon} real fp16 steps (CPU, 1 thread) against the replay of a trace "
        f"recorded on the same test instances ({args.instances} per pair, seeds 100..), for "
        f"{len({e['scaler'] for e in episodes})} scalers: every built-in rule, the tuned rules "
        + ", ".join(f"`{n}` ({b} {k})" for n, (b, k) in TUNED.items())
        + ", and a seeded random policy (+-2 bits per step). Scenario parameters: "
        + ", ".join(f"{s} {SCENARIOS[s]}" for s in args.scenarios)
        + f". Wall time {wall / 60:.1f} min.",
        "",
        f"Verdict: `yes` within 20% relative; `abs` off by more than 20% relative but at most "
        f"{ABS_TOL} absolute; `NO` otherwise. Values are means over the instances. "
        f"`extra skips`: steps per episode the real run skipped that the recording did not; "
        f"`departs at`: first step (over the instances) whose real loss differs from the "
        f"recorded loss (`-`: never, the real run followed the recorded trajectory exactly).",
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
    lines += ["", "## Gap against the horizon", ""]
    lines += [
        "| steps | mean abs. gap skip rate | max | mean abs. gap precision loss | max | episodes departed |",
        "|---|---|---|---|---|---|",
    ]
    for g in grow:
        lines.append(
            f"| {g['steps']} | {fmt(g['mean_abs_skip_rate'])} | {fmt(g['max_abs_skip_rate'])} | "
            f"{fmt(g['mean_abs_precision_loss'])} | {fmt(g['max_abs_precision_loss'])} | "
            f"{g['departed']} of {g['episodes']} |"
        )
    lines += ["", "## Gap against extra skips", ""]
    lines.append(
        f"Over {corr['skip_rate']['n']} episodes, extra skips per step (real skips the recording did "
        f"not have) against the absolute gap over {horizon} steps: skip rate Pearson "
        f"{corr['skip_rate']['pearson']:.2f}, Spearman {corr['skip_rate']['spearman']:.2f}; precision "
        f"loss Pearson {corr['precision_loss']['pearson']:.2f}, Spearman "
        f"{corr['precision_loss']['spearman']:.2f}."
    )
    u, d = corr["undeparted"], corr["departed"]
    lines.append(
        f"Episodes whose real run never left the recorded trajectory ({u['episodes']}): mean abs. gap "
        f"skip rate {fmt(u['mean_abs_skip_rate'])}, precision loss {fmt(u['mean_abs_precision_loss'])}. "
        f"Episodes that left it ({d['episodes']}): {fmt(d['mean_abs_skip_rate'])} and "
        f"{fmt(d['mean_abs_precision_loss'])}."
    )
    lines += ["", "## Per scaler", ""]
    lines += [
        f"| workload | scenario | scaler | metric | real {prefix} | replay {prefix} | rel. {prefix} "
        f"| real {horizon} | replay {horizon} | abs. {horizon} | rel. {horizon} | verdict | "
        "extra skips | departs at |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dep = (
            "-"
            if r["departs_at"] is None
            else f"{r['departs_at']} ({r['departed']}/{r['instances']})"
        )
        lines.append(
            f"| {r['workload']} | {r['scenario']} | {r['scaler']} | {r['metric']} | "
            f"{fmt(r[f'real_{prefix}'])} | {fmt(r[f'replay_{prefix}'])} | {pct(r[f'rel_{prefix}'])} | "
            f"{fmt(r[f'real_{horizon}'])} | {fmt(r[f'replay_{horizon}'])} | {fmt(r[f'abs_{horizon}'])} | "
            f"{pct(r[f'rel_{horizon}'])} | {r[f'ok_{horizon}']} | {r['extra_skips']:.1f} | {dep} |"
        )
    off = [r for r in rows if r[f"ok_{horizon}"] == "NO"]
    if off:
        lines += ["", f"## Where it drifts over {horizon} steps (verdict NO)", ""]
        lines += [
            "| workload | scenario | scaler | metric | real | replay | why |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in off:
            lines.append(
                f"| {r['workload']} | {r['scenario']} | {r['scaler']} | {r['metric']} | "
                f"{fmt(r[f'real_{horizon}'])} | {fmt(r[f'replay_{horizon}'])} | {r['why']} |"
            )
    return lines


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
    args = p.parse_args(argv)
    if args.gpt2 and "gpt2-tiny" not in args.workloads:
        args.workloads.append("gpt2-tiny")
    if not 0 < args.prefix <= args.steps:
        p.error(f"--prefix must be in 1..--steps ({args.steps}), got {args.prefix}")

    import torch

    from autoscale.envs.suite import SuiteSpec

    torch.set_num_threads(1)
    suite = SuiteSpec.from_dict(
        suite_dict(args.workloads, args.scenarios, args.steps, args.instances)
    )
    checkpoints = sorted({args.prefix, *(c for c in (256, 512) if c < args.steps), args.steps})

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    episodes = []
    for member in suite.members:
        episodes.extend(run_member(member, args.steps, checkpoints, log))
    wall = time.perf_counter() - t0
    rows = rows_of(episodes, args.steps, args.prefix)
    grow = growth(episodes, checkpoints)
    corr = correlation(episodes, args.steps)
    lines = report(args, episodes, rows, grow, corr, args.steps, args.prefix, wall)
    print("\n".join(lines))
    if args.out:
        from autoscale.training.scorecard import json_safe

        command = "python " + " ".join(sys.argv)
        with open(args.out, "w") as fh:
            fh.write(
                f"# Replay fidelity at long horizons\n\n`{command}`\n\n" + "\n".join(lines) + "\n"
            )
        data = {
            "command": command,
            "suite": suite.to_dict(),
            "tuned": TUNED,
            "rows": rows,
            "growth": grow,
            "correlation": corr,
            "episodes": episodes,
            "wall_s": wall,
        }
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as fh:
            json.dump(json_safe(data), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
