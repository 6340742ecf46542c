"""Per-step cost of each autoscale rule against ``torch.amp.GradScaler`` on the same loop.

Two measurements, printed in one run:

1. **Small model: the fixed cost of a step, in microseconds.** A small conv net (3 -> 4 -> 4
   channels on 8x8 images, a linear head; about 1 ms a step) under fp16 autocast on the CPU,
   where a scaler's fixed cost (Python calls, small tensor ops) weighs most. GradScaler and the
   ``--small-rules`` (default ``torch`` and ``auto``) each train their own copy, in blocks of
   ``--small-steps`` steps taken in turn (:func:`rotation`: each in each place of the order
   about equally often; ``--small-repeats`` rounds). Per rule: the overhead per step, the median over
   rounds of (rule block - GradScaler block) / steps, in microseconds; the median step's (the
   median of every step's time, minus GradScaler's: a step another process preempted moves its
   block, hardly the median step); and the time attributed to the scaler (below). Targets,
   held to the median step's overhead: :data:`SMALL_TARGET_US` (counter rules 20 us, ``auto``
   and the amax rules 50 us).
2. **Large model: the ratio.** Every rule (or ``--rules``) trains its own copy of an MLP
   (``--width``, ``--depth``) under autocast (bf16 on CPU, so that the time is not fp16
   emulation; fp16 on CUDA), and so does a plain GradScaler. Blocks of ``--steps`` steps
   alternate rule / baseline (the order flips every repeat); the same runs give two estimates of
   the per-step time ratio:

   - ``blocks``: median over the block pairs of (rule block time / baseline block time), wall
     time (on CUDA, the GPU runs async, so whole blocks are what counts);
   - ``attributed``: 1 + (scaler time of the rule - scaler time of GradScaler) / baseline step
     time, where the scaler time of a step is the wall time spent in ``scale``, ``step`` and
     ``update`` minus the time inside ``optimizer.step``, medians over all timed steps. On a
     shared CPU machine the load of other processes makes whole blocks vary by tens of
     percent, while a window of some tens of microseconds is rarely preempted: this is the
     estimate held to the target on CPU.

Host syncs per step are counted too: on CUDA with ``torch.cuda.set_sync_debug_mode("warn")``
(every synchronizing call, hidden host-to-device copies included); on CPU by counting the explicit
device-to-host reads (``Tensor.item``/``tolist``/``__bool__``/``__float__``/``__int__``) made by
GradScaler's and autoscale's code. A scaler on a CPU reads its few scalars directly (a read is no
sync there); on CUDA it packs them into one read, which the CUDA count is of.

Usage::

    python experiments/benchmarks/scaler_overhead.py --rules torch,auto --optimizers adamw \\
        --out experiments/results/scaler_overhead.md
    python experiments/benchmarks/scaler_overhead.py --skip-large   # the small model alone
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import torch

import autoscale
from autoscale.scalers import find_policy

TARGET = 1.05  # every rule, those that read gradient statistics included
TARGETS = {"auto": 1.03}  # the shipped rule (amax-loss with its per-step guard): tighter
SMALL_TARGET_US = 20.0  # fixed cost per step on the small model: the counter rules
SMALL_TARGETS_US = {"auto": 50.0, "amax-history": 50.0, "amax-cap": 50.0, "amax-loss": 50.0}


def small_target(name: str) -> float:
    """A rule's or policy's small-model target: the counter rules' where it reads no gradient
    statistics, else the amax rules' (a policy on auto's rule reads what auto reads)."""
    from autoscale import get_scaler

    return 50.0 if get_scaler(name, device="cpu").controller.rule.needs_stats else SMALL_TARGET_US


SHIPPED = ("auto",)  # policies timed by default besides the built-in rules
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
SCALER_CODE = (
    str(Path(torch.amp.grad_scaler.__file__).resolve()),
    str(Path(autoscale.__file__).resolve().parent),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block")
    p.add_argument("--repeats", type=int, default=15, help="rule/baseline block pairs per rule")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (CUDA when present)")
    p.add_argument("--width", type=int, default=512, help="MLP width")
    p.add_argument("--depth", type=int, default=4, help="MLP hidden layers")
    p.add_argument("--batch", type=int, default=64, help="batch size")
    p.add_argument(
        "--optimizers", default="adamw,fused", help="comma-separated: adamw (foreach), fused"
    )
    p.add_argument(
        "--rules",
        default="",
        help="comma-separated rule names (default: every registered rule, and auto)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp16", "bf16", "fp32"),
        help="autocast dtype; auto: fp16 on CUDA, bf16 on a CPU (fp32: no autocast, the fastest "
        "step on a CPU without bf16 units, where a fixed cost weighs most)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave as is)")
    p.add_argument(
        "--small-rules", default="torch,auto", help="rules timed on the small model ('' for none)"
    )
    p.add_argument("--small-steps", type=int, default=60, help="steps per small-model block")
    p.add_argument(
        "--small-repeats", type=int, default=201, help="rounds of small-model blocks (about 35 s)"
    )
    p.add_argument("--skip-large", action="store_true", help="only the small model")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    return p.parse_args(argv)


def autocast_dtype(name: str, device_type: str):
    """The autocast dtype of ``--dtype`` (None: no autocast)."""
    if name == "auto":
        name = "fp16" if device_type == "cuda" else "bf16"
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[name]


def dtype_name(name: str, device_type: str) -> str:
    dtype = autocast_dtype(name, device_type)
    return "fp32 (no autocast)" if dtype is None else f"{str(dtype).split('.')[-1]} autocast"


class Job:
    """One scaler training its own copy of a model, timing the scaler's share of each step.

    ``batch``: the model's input and target; ``loss_fn(output, target)``; ``dtype``: the
    autocast dtype (None: none)."""

    def __init__(
        self,
        label: str,
        scaler,
        model: torch.nn.Module,
        fused: bool,
        device: torch.device,
        dtype,
        batch: tuple[torch.Tensor, torch.Tensor],
        loss_fn,
    ) -> None:
        self.label, self.scaler, self.model = label, scaler, model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        self.device, self.dtype = device, dtype
        self.x, self.y = batch
        self.loss_fn = loss_fn
        self.scaler_s: list[float] = []
        self.step_s: list[float] = []  # each whole step's wall time
        self._opt_s = 0.0
        inner = self.opt.step

        def timed_step(*a, **k):
            start = time.perf_counter()
            out = inner(*a, **k)
            self._opt_s = time.perf_counter() - start
            return out

        self.opt.step = timed_step

    def step(self) -> None:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(
            self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None
        ):
            out = self.model(self.x)
        loss = self.loss_fn(out.float(), self.y)
        self._opt_s = 0.0
        t0 = time.perf_counter()
        scaled = self.scaler.scale(loss)
        t1 = time.perf_counter()
        scaled.backward()
        t2 = time.perf_counter()
        self.scaler.step(self.opt)
        self.scaler.update()
        t3 = time.perf_counter()
        self.scaler_s.append((t1 - t0) + (t3 - t2) - self._opt_s)
        self.step_s.append(t3 - start)

    def block(self, steps: int) -> float:
        """Wall seconds per step over ``steps`` steps."""
        _sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(self.device)
        return (time.perf_counter() - start) / steps


def mlp_job(label: str, scaler, model: torch.nn.Module, fused: bool, args) -> Job:
    """A :class:`Job` of the large model: the MLP on one random batch, MSE."""
    device = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, args.width, generator=g).to(device)
    dtype = autocast_dtype(args.dtype, device.type)
    return Job(label, scaler, model, fused, device, dtype, (x, y), torch.nn.functional.mse_loss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def count_host_syncs(device: torch.device):
    """Yields a one-element list that holds the number of host syncs seen inside the block."""
    seen = [0]
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen[0] = sum("synchroniz" in str(w.message) for w in caught)
        return
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(fn):
        def wrapper(self, *a, **k):
            # only the scalers' reads: AdamW reads its CPU step counters, which never sync
            if sys._getframe(1).f_code.co_filename.startswith(SCALER_CODE):
                seen[0] += 1
            return fn(self, *a, **k)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def syncs_per_step(job: Job, steps: int = 10) -> float:
    with count_host_syncs(job.device) as seen:
        for _ in range(steps):
            job.step()
        _sync(job.device)
    return seen[0] / steps


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(args.device)


def measure(args, rule: str, fused: bool, model: torch.nn.Module) -> dict:
    base = mlp_job(
        "GradScaler", torch.amp.GradScaler(args.device), copy.deepcopy(model), fused, args
    )
    ours = mlp_job(
        rule, autoscale.get_scaler(rule, device=args.device), copy.deepcopy(model), fused, args
    )
    for job in (base, ours):  # warm-up: allocator, kernels, lazy state
        job.block(max(3, args.steps // 5))
        job.scaler_s.clear()
    ratios, t_base, t_rule = [], [], []
    for r in range(args.repeats):
        order = (base, ours) if r % 2 == 0 else (ours, base)
        times = {job.label: job.block(args.steps) for job in order}
        t_base.append(times["GradScaler"])
        t_rule.append(times[rule])
        ratios.append(times[rule] / times["GradScaler"])
    step_s = statistics.median(t_base)
    base_us = statistics.median(base.scaler_s) * 1e6
    rule_us = statistics.median(ours.scaler_s) * 1e6
    attributed = 1 + (rule_us - base_us) * 1e-6 / step_s
    blocks = statistics.median(ratios)
    target = TARGETS.get(rule, TARGET)
    held = blocks if torch.device(args.device).type == "cuda" else attributed
    return {
        "rule": rule,
        "optimizer": "AdamW(fused=True)" if fused else "AdamW",
        "step_ms": step_s * 1e3,
        "base_us": base_us,
        "rule_us": rule_us,
        "attributed": attributed,
        "blocks": blocks,
        "spread": (min(ratios), max(ratios)),
        "target": target,
        "ok": held <= target,
        "syncs_base": syncs_per_step(base),
        "syncs_rule": syncs_per_step(ours),
    }


def small_model() -> torch.nn.Module:
    """The small model: two 3x3 convolutions (3 -> 4 -> 4 channels) on 8x8 images, a linear
    head of 10 classes (2,830 parameters; about 1 ms a step at fp16 on one CPU thread)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 10),
    )


def rotation(jobs: list, r: int) -> list:
    """The order of round ``r``: rotated by one place every two rounds, reversed every other
    round. Over each ``2 * len(jobs)`` rounds every job takes every place equally often (over
    other round counts, nearly), and comes before each other job as often as after it; with
    three jobs it also follows each other job directly equally often (with four or more, only
    its neighbours in the rotation). Reversal alone left the middle of three jobs in the middle
    every round, and a block's time depends on the block before it by a few microseconds a step."""
    k = (r // 2) % len(jobs)
    order = jobs[k:] + jobs[:k]
    return order if r % 2 == 0 else order[::-1]


def measure_small(args, rules: list[str]) -> list[dict]:
    """The small model's per-step overhead of each rule against GradScaler, in one rotation
    (GradScaler and every rule each take a block in turn, in :func:`rotation`'s order)."""
    device = torch.device(args.device)
    dtype = torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = (
        torch.randn(8, 3, 8, 8, generator=g).to(device),
        torch.randint(0, 10, (8,), generator=g).to(device),
    )
    loss = torch.nn.functional.cross_entropy
    model = small_model().to(device)

    def job(label: str, scaler) -> Job:
        return Job(label, scaler, copy.deepcopy(model), False, device, dtype, batch, loss)

    jobs = [job("GradScaler", torch.amp.GradScaler(args.device))]
    jobs += [job(rule, autoscale.get_scaler(rule, device=args.device)) for rule in rules]
    for j in jobs:  # warm-up: allocator, kernels, lazy state
        j.block(max(5, args.small_steps // 2))
        j.scaler_s.clear()
        j.step_s.clear()
    times: dict[str, list[float]] = {j.label: [] for j in jobs}
    for r in range(args.small_repeats):
        for j in rotation(jobs, r):
            times[j.label].append(j.block(args.small_steps))
    base = times["GradScaler"]
    base_us = statistics.median(jobs[0].scaler_s) * 1e6
    base_step_us = statistics.median(jobs[0].step_s) * 1e6
    rows = []
    for j in jobs[1:]:
        extra = sorted((t - b) * 1e6 for t, b in zip(times[j.label], base))
        target = SMALL_TARGETS_US.get(j.label, small_target(j.label))
        over = statistics.median(extra)
        per_step = statistics.median(j.step_s) * 1e6 - base_step_us
        rows.append(
            {
                "rule": j.label,
                "step_us": statistics.median(base) * 1e6,
                "over_us": over,
                "quartiles": (extra[len(extra) // 4], extra[(3 * len(extra)) // 4]),
                "ratio": statistics.median(t / b for t, b in zip(times[j.label], base)),
                "per_step_us": per_step,
                "base_us": base_us,
                "rule_us": statistics.median(j.scaler_s) * 1e6,
                "target": target,
                "ok": per_step <= target,
            }
        )
    return rows


def small_table(rows: list[dict], args) -> str:
    n_params = sum(p.numel() for p in small_model().parameters())
    lines = [
        "## Small model: fixed cost per step (microseconds)",
        "",
        f"- conv net 3 -> 4 -> 4 channels, 8x8 images, batch 8, linear head ({n_params:,} "
        f"parameters), fp16 autocast, AdamW, device {args.device}; {args.small_repeats} rounds "
        f"of {args.small_steps}-step blocks, GradScaler and every rule in turn, each in each "
        "place of the order about equally often",
        "- overhead = median over rounds of (rule block - GradScaler block) / steps; IQR: its "
        "quartiles; per step: median of the rule's step times - median of GradScaler's (a "
        "step that another process preempted moves a block's time, hardly the median step); "
        "scaler us: median time per step in scale + step + update minus optimizer.step "
        "(GradScaler's, then the rule's); met: the per-step overhead against the target",
        "",
        "| rule | GradScaler step us | overhead us | IQR us | ratio | per step us "
        "| GradScaler scaler us | rule scaler us | target us | met |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lo, hi = r["quartiles"]
        lines.append(
            f"| {r['rule']} | {r['step_us']:.0f} | {r['over_us']:.1f} | {lo:.1f}..{hi:.1f} | "
            f"{r['ratio']:.3f} | {r['per_step_us']:.1f} | {r['base_us']:.1f} | "
            f"{r['rule_us']:.1f} | "
            f"<= {r['target']:.0f} | {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def table(rows: list[dict], args, n_params: int) -> str:
    cuda = torch.device(args.device).type == "cuda"
    lines = [
        "## Large model: the ratio",
        "",
        f"- MLP {args.depth}x{args.width} ({n_params:,} fp32 parameters), batch {args.batch}, "
        f"{dtype_name(args.dtype, 'cuda' if cuda else 'cpu')}; {args.repeats} interleaved block pairs of "
        f"{args.steps} steps per rule and optimizer",
        "- step ms: median GradScaler step; scaler us: median per step of the time in scale + "
        "step + update minus optimizer.step",
        "- attributed ratio = 1 + (rule us - GradScaler us) / GradScaler step; blocks ratio = "
        "median of (rule block / GradScaler block), spread = min..max of the pairs",
        f"- met: the {'blocks' if cuda else 'attributed'} ratio against the target"
        + ("" if cuda else " (block times on a shared CPU machine vary by tens of percent)"),
        "- host syncs per step counted by "
        + (
            "sync-debug mode"
            if cuda
            else "explicit reads (a scaler on a CPU reads its few scalars one by one: no "
            "syncs there; on CUDA it packs them into one read)"
        ),
        "",
        "| rule | optimizer | step ms | GradScaler us | rule us | attributed ratio "
        "| blocks ratio | spread | target | met | syncs GradScaler | syncs rule |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['optimizer']} | {r['step_ms']:.3f} | {r['base_us']:.1f} | "
            f"{r['rule_us']:.1f} | {r['attributed']:.3f} | {r['blocks']:.3f} | "
            f"{r['spread'][0]:.2f}..{r['spread'][1]:.2f} | <= {r['target']:.2f} | "
            f"{'yes' if r['ok'] else 'NO'} | {r['syncs_base']:g} | {r['syncs_rule']:g} |"
        )
    return "\n".join(lines) + "\n"


def header(args) -> str:
    cuda = torch.device(args.device).type == "cuda"
    return (
        "# Scaler overhead against torch.amp.GradScaler\n\n"
        f"- {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"autoscale {autoscale.__version__}, {platform.machine()}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else "")
        + f", {torch.get_num_threads()} CPU thread(s)\n"
        f"- `python experiments/benchmarks/scaler_overhead.py {' '.join(args.argv)}`\n"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = [header(args)]
    small_rules = [r for r in args.small_rules.split(",") if r]
    if small_rules:
        small = measure_small(args, small_rules)
        for row in small:
            print(
                f"{row['rule']:>13} small model: {row['over_us']:+.1f} us/step over "
                f"GradScaler's {row['step_us']:.0f} us (median step {row['per_step_us']:+.1f})",
                flush=True,
            )
        parts.append(small_table(small, args))
    if not args.skip_large:
        rules = [r for r in args.rules.split(",") if r] or [
            i.name for i in autoscale.list_scalers() if i.kind != "policy"
        ] + [n for n in SHIPPED if find_policy(n) is not None]
        model = make_model(args)
        n_params = sum(p.numel() for p in model.parameters())
        rows = []
        for fused in [o.strip() == "fused" for o in args.optimizers.split(",") if o.strip()]:
            for rule in rules:
                row = measure(args, rule, fused, model)
                rows.append(row)
                print(
                    f"{row['rule']:>13} {row['optimizer']:<18} attributed "
                    f"{row['attributed']:.3f} blocks {row['blocks']:.3f}",
                    flush=True,
                )
        parts.append(table(rows, args, n_params))
    text = "\n".join(parts)
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
