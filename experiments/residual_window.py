"""How long a residual agent's offset should hold: the window K, chosen by measurement.

Trains one residual PPO agent on ``auto`` per window (same replay steps for each: ``--steps``
replayed training steps, so a shorter window gets more decisions), on the replay of the suite's
train members, to the bar, selected on one held-out train instance per member; then replays each,
``auto`` and ``torch`` on those held-out instances (never trained on) over whole 512-step
episodes, and gives the objective against torch, the skip rate beside torch's, and the share of
the hindsight limit. Replay, not real steps: this compares windows, it does not judge a policy
(experiments/residual_agents.py and the build do that on real steps of members none trained on).

    OMP_NUM_THREADS=1 python experiments/residual_window.py            # about 5 minutes here

Writes experiments/results/residual_window.md (and .json).
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
BUILD_CACHE = ROOT / "experiments" / ".cache" / "auto"
WORK = ROOT / "experiments" / ".cache" / "residual_window"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--windows", default="4,8,16,32,64")
    p.add_argument("--steps", type=int, default=320_000, help="replayed training steps each")
    p.add_argument("--horizon", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "residual_window.md")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from autoscale.agents.evaluate import evaluate_scalers
    from autoscale.agents.residual import train_residual
    from autoscale.envs.episodes import instance_names, make_env, scaler_for
    from autoscale.envs.limit import episodes_limit, limit_share
    from autoscale.envs.suite import load_spec
    from autoscale.envs.suite_env import split_instance
    from autoscale.search.objective import objective
    from autoscale.search.traces import load_traces
    from autoscale.selection.agents import rl_suite

    suite = load_spec(ROOT / "envs" / "suite.yaml")
    spec = rl_suite(suite, args.horizon, 1)
    traces, _ = load_traces(spec, BUILD_CACHE, 2 * args.horizon, cost=lambda m, n: 0.0,
                            stop_at=math.inf)  # fmt: skip
    member = spec.members[0]
    factories = {n: (lambda n=n: scaler_for(n, member)) for n in ("auto", "torch")}
    wall = {}
    for k in (int(w) for w in args.windows.split(",")):
        name = f"rl-res-ppo-k{k}"
        t0 = time.monotonic()
        result = train_residual(
            spec, "ppo", args.steps // k, replay=traces, select_on="test", window=k,
            seed=args.seed, export_name=name, export_dir=str(WORK), force=True,
        )  # fmt: skip
        wall[name] = time.monotonic() - t0
        factories[name] = lambda p=result.policy_dir: scaler_for(str(p), member)
        print(f"{name}: {args.steps // k} decisions in {wall[name]:.0f} s", flush=True)
    cards = evaluate_scalers(spec, factories, instances="test", trace=traces)
    names = instance_names(make_env(spec, "test", traces))
    by_member: dict[str, dict[str, list]] = {}
    for scaler, cs in cards.items():
        for inst, card in zip(names, cs):
            by_member.setdefault(scaler, {}).setdefault(split_instance(inst)[0], []).append(card)
    limits = {
        m.name: episodes_limit(
            traces[m.name], [i.name for i in m.instances["test"]], args.horizon, m.episode
        )[0]
        for m in spec.members
    }
    rows = {}
    for scaler, per in by_member.items():
        obj = objective(per, by_member["torch"], suite.reward)
        skips = [c.skip_rate for cs in per.values() for c in cs]
        ref = [c.skip_rate for cs in by_member["torch"].values() for c in cs]
        shares = [
            limit_share(by_member["torch"][m][0].precision_loss, cs[0].precision_loss, limits[m])
            for m, cs in per.items()
        ]
        shares = [s for s in shares if s is not None]
        rows[scaler] = {
            "objective": obj,
            "skip_rate": sum(skips) / len(skips),
            "torch_skip_rate": sum(ref) / len(ref),
            "mean_limit_share": sum(shares) / len(shares) if shares else None,
            "train_s": wall.get(scaler),
        }
    out = {"settings": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    lines = [
        "# The residual agent's window",
        "",
        f"`OMP_NUM_THREADS=1 python experiments/residual_window.py --windows {args.windows} "
        f"--steps {args.steps}`: one residual PPO agent on `auto` per window, {args.steps} replayed "
        "training steps each, on the train members' replay, to the bar; replayed on one held-out "
        f"train instance per member ({args.horizon} steps, never trained on). Replay compares the "
        "windows; real steps judge policies (residual_agents.md, the build).",
        "",
        "| policy | objective vs torch (replay) | skip rate (torch's) | mean share of the limit | "
        "training (s) |",
        "|---|---|---|---|---|",
    ]
    for n, r in sorted(rows.items(), key=lambda kv: kv[1]["objective"]):
        share, train_s = r["mean_limit_share"], r["train_s"]
        lines.append(
            f"| {n} | {r['objective']:+.4f} | {100 * r['skip_rate']:.2f}% "
            f"({100 * r['torch_skip_rate']:.2f}%) | {'-' if share is None else f'{share:.3f}'} | "
            f"{'-' if train_s is None else f'{train_s:.0f}'} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
