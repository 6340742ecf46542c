"""The no-harm check of every policy in a folder (default: the shipped ``policies/``).

Each policy trains long runs (a warm-up and a cosine learning-rate decay) of ``mlp`` and
``gpt2-tiny`` with nothing wrong with the data, and of ``mlp`` whose gradients drift down and then
up by orders of magnitude over the run, next to the ``torch`` rule (GradScaler's defaults) on the
same seeds, exactly as ``autoscale search`` checks a candidate before exporting it
(:mod:`autoscale.search.no_harm`): it fails when it skips more than torch + 0.5% of the steps, ends
with a held-out loss worse than torch's beyond the seed noise, or diverges.

    python experiments/no_harm.py [--steps 1000] [--policies policies] [--out experiments/results/no_harm.md]

torch's runs are cached in ``experiments/.cache/no-harm`` (deterministic: paid once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--policies", default=str(ROOT / "policies"))
    p.add_argument("--models", default="mlp,gpt2-tiny")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "no_harm.md"))
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from autoscale.scalers import make_scaler
    from autoscale.search.budget import Ledger
    from autoscale.search.no_harm import NoHarmCheck, no_harm_workloads
    from autoscale.search.timing import NoHarmPlan
    from autoscale.search.workload import base_spec

    members = [base_spec(model=m) for m in args.models.split(",")]
    no_harm = NoHarmPlan(no_harm_workloads(members, args.steps), args.steps)
    folder = ROOT / "experiments" / ".cache" / "no-harm"
    names = sorted(d.name for d in Path(args.policies).iterdir() if (d / "policy.yaml").is_file())
    rows, verdicts = [], {}
    t0 = time.monotonic()
    for name in names:
        path = str(Path(args.policies) / name)
        probe = make_scaler(path, device="cpu")
        scale = {
            "init_scale": probe.init_scale,
            "min_scale": probe.min_scale,
            "max_scale": probe.max_scale,
        }
        check = NoHarmCheck(no_harm, folder, Ledger(), scale)
        verdict = check.check(lambda path=path: make_scaler(path, device="cpu"), name)
        verdicts[name] = verdict.to_dict()
        for model, runs in verdict.runs.items():
            c, t = runs["candidate"][0], runs["torch"][0]
            rows.append(
                f"| {name} | {model} | {100 * c['skip_rate']:.2f}% | {100 * t['skip_rate']:.2f}% | "
                f"{c['eval_loss']:.5g} | {t['eval_loss']:.5g} | {runs['noise']:.2g} | "
                f"{'yes' if verdict.passed else 'NO'} |"
            )
        print(verdict.summary(), flush=True)
    lines = [
        "# No-harm check of the policies",
        "",
        f"`python experiments/no_harm.py {' '.join(argv or sys.argv[1:])}`".replace("  ", " "),
        "",
        f"Long runs ({args.steps} steps, warm-up {no_harm.workloads[0].scenario_params['warmup']} "
        "steps then cosine decay; seed 0), clean and, for mlp, with gradients that drift down and "
        f"up by orders of magnitude (`mlp/drift`), next to torch (GradScaler's defaults) on the same seed; "
        "seed noise = spread of torch's final eval loss over seeds 0 and 1 (at least 0.2% of it). "
        f"Took {time.monotonic() - t0:.0f} s.",
        "",
        "| policy | workload | skipped | torch skipped | eval loss | torch eval loss | seed noise | passes |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    for name, v in verdicts.items():
        if not v["passed"]:
            lines.append(f"- **{name}** fails: " + "; ".join(v["reasons"]))
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(verdicts, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
