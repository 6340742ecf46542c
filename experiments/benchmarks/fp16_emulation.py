"""Emulated fp16 against native fp16 autocast on the CPU: do they train the same?

The emulated path (``WorkloadSpec.fp16="emulated"``, :mod:`autoscale.training.fp16`) computes the
matrix products of fp16 autocast in fp32 and rounds them to fp16; the native path runs torch's
fp16 CPU kernels. Three measurements, side by side in one run:

1. **ops**: the emulated-op outputs against the native kernels' on random fp16 operands of
   gpt2-tiny's shapes: share of elements that differ, and by how many fp16 ulps.
2. **paired steps**: one native run (``torch`` rule, traced); before each of its steps, an
   emulated run restores the native run's snapshot and takes the same step from the same state
   (weights, scale, batch, dropout). Per step: overflow threshold in log2(scale) (from the amax
   of every fp16 tensor of the backward, as traces record it), found-inf, precision loss, loss.
3. **free runs**: every built-in rule trains N steps on each path from the same seed: steps
   whose skip decision differs, skips, mean precision loss, final scale and loss.

    python experiments/benchmarks/fp16_emulation.py --steps 64 \\
        --out experiments/results/fp16_emulation.md

Runs with one torch thread (``--threads``), as the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-tiny,mlp", help="comma-separated model presets")
    p.add_argument("--scenarios", default="clean,moving", help="comma-separated scenarios")
    p.add_argument("--steps", type=int, default=64, help="steps per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rules", default="", help="comma-separated rules (default: every built-in rule)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    p.add_argument("--out", type=Path, help="write the report here (markdown, and .json beside)")
    return p.parse_args(argv)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of fp16 (at the larger magnitude), elementwise."""
    a, b = a.float(), b.float()
    big = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-14)
    ulp = torch.exp2(torch.floor(torch.log2(big)) - 10)
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, torch.zeros_like(a), (a - b).abs() / ulp)


def op_differences(seed: int) -> list[dict[str, Any]]:
    """Emulated against native kernels, and each against the exact result (fp64, rounded once to
    fp16), on random operands of gpt2-tiny's shapes."""
    from autoscale.training.fp16 import Fp16EmulationMode

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).half()  # noqa: E731
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = {
        "mm 256x64 @ 64x256": (torch.mm, (r(256, 64), r(64, 256))),
        "addmm 256x256 @ 256x64 (+bias)": (torch.addmm, (r(64), r(256, 256), r(256, 64))),
        "bmm 8x64x32 @ 8x32x64": (torch.bmm, (r(8, 64, 32), r(8, 32, 64))),
        "sdpa causal 4x2x64x32 (flash kernel)": (
            lambda q, k, v: sdpa(q, k, v, is_causal=True),
            (r(4, 2, 64, 32), r(4, 2, 64, 32), r(4, 2, 64, 32)),
        ),
    }
    rows = []
    for name, (fn, operands) in cases.items():
        native = fn(*operands)
        with Fp16EmulationMode() as mode:
            emulated = fn(*operands)
        exact = fn(*(t.double() for t in operands)).half()
        d, dn, de = ulps(native, emulated), ulps(exact, native), ulps(exact, emulated)
        rows.append(
            {
                "op": name,
                "elements": native.numel(),
                "emulated_calls": mode.calls,
                "differ": float((d > 0).float().mean()),
                "max_ulps": float(d.max()),
                "native_vs_exact_differ": float((dn > 0).float().mean()),
                "native_vs_exact_max_ulps": float(dn.max()),
                "emulated_vs_exact_differ": float((de > 0).float().mean()),
                "emulated_vs_exact_max_ulps": float(de.max()),
            }
        )
    return rows


def paired_steps(spec, steps: int) -> dict[str, Any]:
    """Native run, and from each of its states the same step on the emulated path."""
    from autoscale.training import TrainingRun

    native = TrainingRun(spec.replace(fp16="native"), "torch", record=True)
    emulated = TrainingRun(spec.replace(fp16="emulated"), "torch", record=True)
    cols: dict[str, list] = {
        k: []
        for k in (
            "scale",
            "threshold_native",
            "threshold_emulated",
            "found_inf_native",
            "found_inf_emulated",
            "precision_native",
            "precision_emulated",
            "loss_native",
            "loss_emulated",
        )
    }
    for _ in range(steps):
        snap = native.snapshot()  # both restore it: the RNG (dropout) is process-global
        emulated.restore(snap)
        e = emulated.step()
        native.restore(snap)
        n = native.step()
        cols["scale"].append(n.scale)
        for tag, rec in (("native", n), ("emulated", e)):
            cols[f"threshold_{tag}"].append(rec.overflow_threshold_log2)
            cols[f"found_inf_{tag}"].append(rec.found_inf)
            cols[f"precision_{tag}"].append(rec.precision_loss)
            cols[f"loss_{tag}"].append(rec.loss)
    both = [
        (a, b)
        for a, b in zip(cols["threshold_native"], cols["threshold_emulated"], strict=True)
        if a is not None and b is not None
    ]
    dthr = [abs(a - b) for a, b in both]
    pl = [
        (a, b)
        for a, b in zip(cols["precision_native"], cols["precision_emulated"], strict=True)
        if math.isfinite(a) and math.isfinite(b)
    ]
    losses = [
        abs(a - b) / abs(a)
        for a, b in zip(cols["loss_native"], cols["loss_emulated"], strict=True)
        if math.isfinite(a) and math.isfinite(b) and a
    ]
    return {
        "steps": steps,
        "threshold_steps": len(both),
        "threshold_median_abs_diff": statistics.median(dthr) if dthr else math.nan,
        "threshold_max_abs_diff": max(dthr) if dthr else math.nan,
        "threshold_mean_native": statistics.fmean(a for a, _ in both) if both else math.nan,
        "found_inf_native": sum(cols["found_inf_native"]),
        "found_inf_differ": sum(
            a != b
            for a, b in zip(cols["found_inf_native"], cols["found_inf_emulated"], strict=True)
        ),
        "precision_mean_native": statistics.fmean(a for a, _ in pl) if pl else math.nan,
        "precision_mean_emulated": statistics.fmean(b for _, b in pl) if pl else math.nan,
        "precision_max_abs_diff": max((abs(a - b) for a, b in pl), default=math.nan),
        "loss_max_rel_diff": max(losses, default=math.nan),
        "per_step": cols,
    }


def free_runs(spec, steps: int, rules: list[str]) -> list[dict[str, Any]]:
    """Each rule trained from the same seed on both paths."""
    from autoscale.training import TrainingRun

    rows = []
    for rule in rules:
        recs, cards = {}, {}
        for path in ("native", "emulated"):
            run = TrainingRun(spec.replace(fp16=path), rule)
            cards[path] = run.run(steps)
            recs[path] = run.records
        flags = {p: [r.found_inf for r in recs[p]] for p in recs}
        differ = [i for i, (a, b) in enumerate(zip(flags["native"], flags["emulated"])) if a != b]
        rows.append(
            {
                "rule": rule,
                "skips_native": sum(flags["native"]),
                "skips_emulated": sum(flags["emulated"]),
                "skip_steps_differ": len(differ),
                "first_differing_step": differ[0] if differ else None,
                "precision_native": cards["native"].precision_loss,
                "precision_emulated": cards["emulated"].precision_loss,
                "final_scale_native": recs["native"][-1].scale,
                "final_scale_emulated": recs["emulated"][-1].scale,
                "final_loss_native": cards["native"].final_loss,
                "final_loss_emulated": cards["emulated"].final_loss,
                "skipped_steps_native": [i for i, f in enumerate(flags["native"]) if f],
            }
        )
    return rows


def fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "n/a"
    return format(x, spec)


def report(result: dict[str, Any], command: str) -> str:
    lines = [
        "# fp16 emulation against native fp16 autocast (CPU)",
        "",
        f"`{command}`",
        "",
        f"{result['when']}; {result['machine']}; torch {result['torch']}, "
        f"{result['threads']} thread(s); {result['wall_s']:.0f} s.",
        "",
        "## Op outputs (random fp16 operands, gpt2-tiny's shapes)",
        "",
        "Share of output elements that differ, and the largest difference in fp16 ulps at the "
        "result's magnitude; *exact* is the fp64 result rounded once to fp16. The largest ulp "
        "counts are at results near zero (cancellation), where a sum's fp32 rounding errors are "
        "large relative to the result.",
        "",
        "| op | elements | emulated vs native: differ / max ulps "
        "| native vs exact | emulated vs exact |",
        "|---|---|---|---|---|",
    ]
    for r in result["ops"]:
        lines.append(
            f"| {r['op']} | {r['elements']} | {r['differ']:.2%} / {r['max_ulps']:.0f} "
            f"| {r['native_vs_exact_differ']:.2%} / {r['native_vs_exact_max_ulps']:.0f} "
            f"| {r['emulated_vs_exact_differ']:.2%} / {r['emulated_vs_exact_max_ulps']:.0f} |"
        )
    lines += [
        "",
        "## Paired steps (same state, same batch, `torch` rule)",
        "",
        "Overflow threshold: log2 of the smallest scale at which the step's backward overflows "
        "fp16, from the amax over every fp16 tensor the backward produced "
        "(`BackwardAmaxMode`, as traces record it).",
        "",
        "| workload | steps | threshold (native, mean) | threshold diff median / max (bits) "
        "| found-inf native / differing | precision loss native / emulated (mean) "
        "| precision loss max diff | loss max rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, p in result["paired"].items():
        lines.append(
            f"| {key} | {p['steps']} | {fmt(p['threshold_mean_native'], '.2f')} "
            f"| {fmt(p['threshold_median_abs_diff'], '.4f')} / {fmt(p['threshold_max_abs_diff'], '.4f')} "
            f"| {p['found_inf_native']} / {p['found_inf_differ']} "
            f"| {fmt(p['precision_mean_native'])} / {fmt(p['precision_mean_emulated'])} "
            f"| {fmt(p['precision_max_abs_diff'])} | {fmt(p['loss_max_rel_diff'])} |"
        )
    lines += [
        "",
        "## Free runs (every built-in rule, same seed, each path on its own)",
        "",
        "| workload | rule | skips native / emulated | steps whose skip differs (first) "
        "| precision loss native / emulated | final scale native / emulated "
        "| final loss native / emulated |",
        "|---|---|---|---|---|---|---|",
    ]
    total = differ = 0
    for key, rows in result["free"].items():
        for r in rows:
            total += 1
            differ += r["skip_steps_differ"] > 0
            first = (
                f" ({r['first_differing_step']})" if r["first_differing_step"] is not None else ""
            )
            lines.append(
                f"| {key} | {r['rule']} | {r['skips_native']} / {r['skips_emulated']} "
                f"| {r['skip_steps_differ']}{first} "
                f"| {fmt(r['precision_native'])} / {fmt(r['precision_emulated'])} "
                f"| 2^{math.log2(r['final_scale_native']):.1f} / 2^{math.log2(r['final_scale_emulated']):.1f} "
                f"| {fmt(r['final_loss_native'], '.5g')} / {fmt(r['final_loss_emulated'], '.5g')} |"
            )
    worst = max((p["threshold_max_abs_diff"] for p in result["paired"].values()), default=math.nan)
    worst_pl = max(
        (p["precision_max_abs_diff"] for p in result["paired"].values()), default=math.nan
    )
    lines += [
        "",
        "## Summary",
        "",
        f"- Overflow thresholds from the same state differ by at most {fmt(worst, '.4f')} bits "
        "(table above, per workload and scenario); a skip decision can differ only on a step "
        "whose threshold lies within that distance of the scale used.",
        f"- Skip pattern: identical on {total - differ} of {total} free runs.",
        f"- Precision loss from the same state differs by at most {fmt(worst_pl)} (absolute, per "
        "step). On gpt2-tiny's first step, all but one of the elements whose count moves belong "
        "to the attention's key bias, whose gradient is zero in exact arithmetic (softmax "
        "ignores it): rounding noise, on either side of fp16's normal minimum.",
        "",
        "## Where the two paths cannot agree",
        "",
        "- **Accumulation order.** Both paths multiply and add in fp32 and round once to fp16, but "
        "torch's native fp16 CPU kernels sum in their own order and BLAS (emulated) in another; "
        "the fp32 sums differ in their last bits, which moves a rounded fp16 result by one ulp "
        "where the sum lies near a rounding boundary (the ops table). Those one-ulp differences "
        "feed the next layers and the optimizer, so free runs drift apart slowly in their last "
        "digits (final losses).",
        "- **Roundings inside fused kernels.** The native CPU flash-attention kernel rounds its "
        "softmax probabilities to fp16 before multiplying them with V (as GPU flash kernels "
        "do); the emulated op computes the whole attention in fp32 and rounds only its output "
        "(the sdpa row: native is the one far from exact). In training, GPT-2's attention "
        "dropout sends `scaled_dot_product_attention` to its math path, which on a CPU computes "
        "in fp32 on both paths alike; the flash kernel runs in evaluation (held-out loss) only.",
        "- Every other op (elementwise, normalisation, the fp32 ops autocast upcasts, the casts "
        "and their gradients) runs the same native kernel on the same fp16 or fp32 tensors on "
        "both paths; `pow` is emulated too, and is bit-identical (tests check every fp16 input).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from autoscale.scalers import list_scalers
    from autoscale.training import WorkloadSpec

    rules = [r for r in args.rules.split(",") if r] or [
        i.name for i in list_scalers() if i.kind == "rule"
    ]
    start = time.perf_counter()
    result: dict[str, Any] = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "rules": rules,
        "ops": op_differences(args.seed),
        "paired": {},
        "free": {},
    }
    for model in [m for m in args.models.split(",") if m]:
        for scenario in [s for s in args.scenarios.split(",") if s]:
            key = f"{model} / {scenario}"
            spec = WorkloadSpec(model=model, scenario=scenario, seed=args.seed, init="random")
            print(f"{key}: paired steps", file=sys.stderr, flush=True)
            result["paired"][key] = paired_steps(spec, args.steps)
            print(f"{key}: free runs of {len(rules)} rules", file=sys.stderr, flush=True)
            result["free"][key] = free_runs(spec, args.steps, rules)
    result["wall_s"] = time.perf_counter() - start
    text = report(
        result,
        "python " + " ".join(["experiments/benchmarks/fp16_emulation.py", *(argv or sys.argv[1:])]),
    )
    print(text)
    if args.out:
        args.out.write_text(text)
        from autoscale.training.scorecard import json_safe

        args.out.with_suffix(".json").write_text(
            json.dumps(json_safe(result), indent=1, allow_nan=False) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
