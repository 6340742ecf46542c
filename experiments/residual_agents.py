"""Residual agents on ``auto``: can a learned offset, trained to the bar, beat the rule?

Trains residual agents (an offset in bits on ``auto``'s scale, held for a window, ``auto``'s guard
and backoff as a shield: autoscale/scalers/residual.py) on the replay of the suite's train
members, as the ``auto`` build trains its agents (one train instance per member held out to select
the model on), under the acceptance check's constraints (torch's replay of the same episode, a
Lagrange multiplier per constraint) and, as an ablation, without them. Then measures each, ``auto``
and ``torch`` on real steps of the validation members' held-out instances (none trained on), and
gives each row's skip rate beside torch's, whether it meets the bar, the objective against torch,
and the share of the achievable precision gain it captures, (P_torch - P) / (P_torch - P_limit),
where P_limit is the hindsight limit (autoscale/envs/limit.py) of each member's held-out steps, from
a recording of the same instances (same seeds and start points: the same batches; the weights
follow the recording's own trajectory, so the limit is the recording's, close to but not exactly
each run's).

    OMP_NUM_THREADS=1 python experiments/residual_agents.py                  # about an hour here
    OMP_NUM_THREADS=1 python experiments/residual_agents.py --timesteps 20000 --window 16

Traces and agents are kept under experiments/.cache (the build's traces are shared: the same
train instances); real-step episodes under experiments/.cache/residual/measured. Writes
experiments/results/residual_agents.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
BUILD_CACHE = ROOT / "experiments" / ".cache" / "auto"  # the build's traces of the same instances
WORK = ROOT / "experiments" / ".cache" / "residual"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", default=str(ROOT / "envs" / "suite.yaml"))
    p.add_argument("--timesteps", type=int, default=20_000, help="decisions of training each")
    p.add_argument("--window", type=int, default=16, help="steps an offset holds")
    p.add_argument("--horizon", type=int, default=512, help="replayed episode length")
    p.add_argument("--steps", type=int, default=256, help="real steps of each held-out episode")
    p.add_argument("--agents", default="ppo,dqn,ppo-free",
                   help="algorithms (ALGO-free: trained without the constraints)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "residual_agents.md")
    p.add_argument("--ship", metavar="AGENT",
                   help="ship this run's agent AGENT (e.g. rl-res-ppo-k16) as the residual agent "
                        "a search's first RL trial fine-tunes (autoscale/agents/warm), and stop")  # fmt: skip
    args = p.parse_args(argv)
    if args.ship:
        return ship(args.ship, args.window, json.loads(args.out.with_suffix(".json").read_text()))

    import torch

    torch.set_num_threads(1)
    from autoscale.agents.residual import train_residual
    from autoscale.envs.episodes import scaler_for
    from autoscale.envs.limit import limit_share
    from autoscale.envs.suite import load_spec
    from autoscale.search.traces import load_traces
    from autoscale.selection import suite_eval as ev
    from autoscale.selection.agents import rl_suite
    from autoscale.selection.measured import Measured, files_hash
    from autoscale.training import summarize

    suite = load_spec(args.suite)
    WORK.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_all = t0 = time.monotonic()
    train_suite = rl_suite(suite, args.horizon, 1)
    traces, stats = load_traces(train_suite, BUILD_CACHE, 2 * args.horizon,
                                cost=lambda m, n: 0.0, stop_at=math.inf, progress=True)  # fmt: skip
    timings["record (train members)"] = time.monotonic() - t0
    print(f"traces: {stats['recorded']} recorded, {stats['cached']} cached", flush=True)

    agents: dict[str, Path] = {}
    training: dict[str, dict] = {}
    for label in args.agents.split(","):
        algo, _, free = label.partition("-")
        name = f"rl-res-{algo}-k{args.window}" + ("-free" if free else "")
        t0 = time.monotonic()
        result = train_residual(
            train_suite, algo, args.timesteps, replay=traces, select_on="test",
            window=args.window, constrained=not free, seed=args.seed, progress=True,
            export_name=name, export_dir=str(WORK / "policies"), force=True,
        )  # fmt: skip
        timings[f"train {name}"] = time.monotonic() - t0
        agents[name] = result.policy_dir
        result.model.save(WORK / "policies" / f"{name}.sb3.zip")  # to ship (--ship) or go on
        last = result.multipliers[-20:]
        training[name] = {
            "timesteps": args.timesteps,
            "wall_s": result.wall_s,
            "best_eval_reward": result.best_eval_reward,
            "episodes": len(result.multipliers),
            "last_20_episodes": {
                "skip_violation": sum(v[0] for v in last) / max(1, len(last)),
                "precision_violation": sum(v[1] for v in last) / max(1, len(last)),
                "lambda_skip": last[-1][2] if last else None,
                "lambda_precision": last[-1][3] if last else None,
            },
        }
        print(f"{name}: {args.timesteps} decisions in {result.wall_s:.0f} s, best held-out "
              f"reward {result.best_eval_reward:.3f}, last episodes {training[name]['last_20_episodes']}",
              flush=True)  # fmt: skip

    member = suite.members[0]
    validation = [m.name for m in suite.validation]
    factories = {n: (lambda p=p: scaler_for(str(p), member)) for n, p in agents.items()}
    factories.update({n: (lambda n=n: scaler_for(n, member)) for n in ("auto", "torch")})
    bounds = f" {member.episode.init_scale} {member.episode.min_scale} {member.episode.max_scale}"
    ids = {n: f"policy {files_hash([p])}{bounds}" for n, p in agents.items()}
    ids.update({n: f"rule {n} {{}}{bounds}" for n in ("auto", "torch")})
    ids["auto"] = f"policy {files_hash([ROOT / 'policies' / 'auto'])}{bounds}"
    t0 = time.monotonic()
    cards = ev.held_out(suite, factories, args.steps, members=validation,
                        measured=Measured(WORK / "measured", ids))  # fmt: skip
    timings["held-out real steps (validation members)"] = time.monotonic() - t0
    t0 = time.monotonic()
    limits = ev.member_limits(suite, validation, args.steps, WORK / "limit")
    timings["record (limit)"] = time.monotonic() - t0
    objective = ev.objective_of(cards, validation, suite.reward)

    rows: dict[str, dict] = {}
    for name in cards:
        accept = ev.acceptance(cards, name) if name != "torch" else {}
        per = {}
        for m in validation:
            mine = {k: v["mean"] for k, v in summarize(cards[name][m]).items()}
            ref = {k: v["mean"] for k, v in summarize(cards["torch"][m]).items()}
            per[m] = {
                "skip_rate": mine["skip_rate"],
                "torch_skip_rate": ref["skip_rate"],
                "precision_loss": mine["precision_loss"],
                "torch_precision_loss": ref["precision_loss"],
                "limit_precision_loss": limits[m],
                "limit_share": limit_share(
                    ref["precision_loss"], mine["precision_loss"], limits[m]
                ),
                "eval_loss": mine["eval_loss"],
                "bar_met": accept[m]["met"] if accept else None,
            }
        shares = [r["limit_share"] for r in per.values() if r["limit_share"] is not None]
        rows[name] = {
            "objective_validation": objective[name],
            "bar_met_on": sum(1 for r in per.values() if r["bar_met"]),
            "mean_limit_share": sum(shares) / len(shares) if shares else None,
            "members": per,
        }
    timings["total"] = time.monotonic() - t_all
    out = {"settings": vars(args) | {"out": str(args.out)}, "timings": timings,
           "training": training, "rows": rows}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    args.out.write_text("\n".join(report(out, validation)) + "\n")
    print("\n".join(report(out, validation)))
    return 0


def ship(name: str, window: int, out: dict) -> int:
    """Ship the agent ``name`` of the last run (its results in ``out``) to autoscale/agents/warm."""
    from autoscale.agents.warm import RESIDUAL, ship_agent
    from autoscale.scalers.policies import read_manifest

    zip_path, folder = WORK / "policies" / f"{name}.sb3.zip", WORK / "policies" / name
    if not (folder / "policy.yaml").is_file() or name not in out["rows"]:
        print(
            f"residual_agents.py: no agent {name!r} in the last run; run it first", file=sys.stderr
        )
        return 2
    p = read_manifest(folder).parameters
    if not zip_path.is_file():  # a run that kept only the export: its actor, a fresh critic
        zip_path = sb3_of_export(folder, p, window)
    row = out["rows"][name]
    agent = ship_agent(
        zip_path, name=name, algo=p["algo"], history=1, scale_time=False, action=p["action"],
        info={"trained_on": "the replay of envs/suite.yaml's train members, to the bar",
              "base": p["base"], "built_by": "experiments/residual_agents.py",
              "objective_validation": row["objective_validation"],
              "bar_met_on_validation": row["bar_met_on"]},
        which=RESIDUAL, window=window,
    )  # fmt: skip
    print(f"shipped {agent.name} as {agent.model}")
    return 0


def sb3_of_export(folder: Path, p: dict, window: int) -> Path:
    """An SB3 PPO model whose actor is the exported one's (its critic new: fine-tuning learns it
    again), saved beside the export, for a run that kept only the exported policy."""
    import torch

    from autoscale.agents.train import sb3_class
    from autoscale.envs.residual_env import ResidualEnv
    from autoscale.envs.suite import load_spec

    if p["algo"] != "ppo" or p["layers"] != [20, 64, 64, 9]:
        raise SystemExit(f"residual_agents.py: {folder.name} is no default PPO agent; run it again")
    suite = load_spec(ROOT / "envs" / "suite.yaml")
    env = ResidualEnv(suite.members[0], "train", None, window=window, constrained=False)
    model = sb3_class("ppo")("MlpPolicy", env, seed=0)
    actor = torch.load(folder / "weights.pt", weights_only=True)["actor"]
    linears = [m for m in model.policy.mlp_extractor.policy_net if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for dst, key in zip([*linears, model.policy.action_net], ("0", "2", "4")):
            dst.weight.copy_(actor[f"{key}.weight"])
            dst.bias.copy_(actor[f"{key}.bias"])
    path = folder.parent / f"{folder.name}.sb3.zip"
    model.save(path)
    return path


def _pct(x) -> str:
    return (
        "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f}%"
    )


def report(out: dict, validation: list[str]) -> list[str]:
    s, rows = out["settings"], out["rows"]
    lines = [
        "# Residual agents on `auto`",
        "",
        f"`OMP_NUM_THREADS=1 python experiments/residual_agents.py --timesteps {s['timesteps']} "
        f"--window {s['window']} --agents {s['agents']}` (total "
        f"{out['timings']['total'] / 60:.1f} min). Agents: an offset in bits (-4..+4) on `auto`'s "
        f"scale, held {s['window']} steps, `auto`'s guard and backoff as a shield; trained on the "
        f"replay of the train members ({s['horizon']}-step episodes), selected on one held-out "
        "train instance per member; `-free`: trained on the weighted objective alone, without "
        "the bar's constraints. Measured on real steps of the validation members' held-out "
        f"instances ({s['steps']} steps, 3 per member), none trained or selected on.",
        "",
        "Share of the limit: (P_torch - P) / (P_torch - P_limit), the share of the precision gain "
        "over torch that the hindsight limit says was there to win (1: all; below 0: worse than "
        "torch; '-': no gain to win).",
        "",
        "| policy | objective (validation, vs torch) | bar met on | mean share of the limit |",
        "|---|---|---|---|",
    ]
    ranked = sorted(
        (n for n in rows if n != "torch"), key=lambda n: rows[n]["objective_validation"]
    )
    for n in ranked:
        r = rows[n]
        share = r["mean_limit_share"]
        lines.append(f"| {n} | {r['objective_validation']:+.4f} | {r['bar_met_on']} of "
                     f"{len(validation)} | {'-' if share is None else f'{share:.3f}'} |")  # fmt: skip
    lines += ["", "Per member: skip rate (torch's), precision loss (torch's; the limit's), share "
              "of the limit, bar.", ""]  # fmt: skip
    head = "| member | " + " | ".join(ranked) + " |"
    lines += [head, "|---" * (len(ranked) + 1) + "|"]
    for m in validation:
        cells = []
        for n in ranked:
            r = rows[n]["members"][m]
            share = r["limit_share"]
            cells.append(
                f"{_pct(r['skip_rate'])} ({_pct(r['torch_skip_rate'])}); "
                f"{_pct(r['precision_loss'])} ({_pct(r['torch_precision_loss'])}; "
                f"{_pct(r['limit_precision_loss'])}); "
                f"{'-' if share is None else f'{share:.2f}'}; {'met' if r['bar_met'] else 'MISSED'}"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Training (decisions, seconds; the mean violation of the last 20 training "
              "episodes and the multipliers at the end):", ""]  # fmt: skip
    for n, t in out["training"].items():
        last = t["last_20_episodes"]
        lines.append(f"- {n}: {t['timesteps']} decisions in {t['wall_s']:.0f} s, {t['episodes']} "
                     f"episodes; skip violation {last['skip_violation']:+.4f}, precision "
                     f"violation {last['precision_violation']:+.4f}, lambda skip "
                     f"{last['lambda_skip']}, lambda precision {last['lambda_precision']}")  # fmt: skip
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in out["timings"].items())]
    return lines


if __name__ == "__main__":
    sys.exit(main())
