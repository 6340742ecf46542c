"""``autoscale doctor``: what this machine offers for mixed precision, measured, and what to use."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autoscale.commands.base import Command
from autoscale.commands.run import check_output, write_json
from autoscale.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16")
TOLERANCE = 0.01  # bf16 is "tolerated" when the held-out loss moves by at most 1% vs fp32


@dataclass
class DtypeResult:
    """One dtype's measurement: median step time, held-out loss at the start, or why it failed."""

    dtype: str
    step_ms: float = math.nan
    eval_loss: float = math.nan
    skipped: int = 0
    error: str | None = None


def device_info(device) -> dict[str, Any]:
    """Name and fp16/bf16 support of ``device`` (a torch.device)."""
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:
            bf16 = torch.cuda.is_bf16_supported()
        return {
            "device": f"cuda:{index}",
            "name": torch.cuda.get_device_name(index),
            "detail": f"compute capability {major}.{minor}, CUDA {torch.version.cuda}",
            "fp16": "native" + (" (tensor cores)" if major >= 7 else ""),
            "bf16": "native" if bf16 else "not supported",
            "bf16_ok": bool(bf16),
        }
    from autoscale.training.fp16 import native_fp16_matmul

    flags = _cpu_flags()
    load, cores = _load(), os.cpu_count() or 1
    return {
        "device": device.type,
        "name": _cpu_name(),
        "detail": f"{torch.get_num_threads()} torch threads, capability {torch.backends.cpu.get_cpu_capability()}",
        "fp16_native": native_fp16_matmul(),
        "fp16": "native (AVX512-FP16/AMX-FP16)"
        if native_fp16_matmul()
        else "no fp16 matrix instructions: torch's fp16 products are scalar loops; "
        "autoscale can emulate them (fp32 products rounded to fp16)",
        "bf16": "native" if flags & {"avx512_bf16", "amx_bf16"} else "emulated (autocast works)",
        "bf16_ok": True,
        "busy": f"load average {load:.1f} on {cores} cores"
        if torch.get_num_threads() > 1 and load > cores
        else None,
    }


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(spec, steps: int, warmup: int = 2, label: str | None = None) -> DtypeResult:
    """Median step time of ``spec`` over ``steps`` steps after ``warmup``, and its initial eval loss."""
    from autoscale.training import TrainingRun

    label = label or spec.dtype
    scaler, kw = ("torch", {}) if spec.dtype == "fp16" else ("static", {"init_scale": 1.0})
    try:
        run = TrainingRun(spec, scaler, **kw)
        eval_loss = run.eval_loss()
        run.run(warmup)
        records = [run.step() for _ in range(steps)]
    except RuntimeError as exc:  # e.g. an autocast dtype this device cannot run
        return DtypeResult(
            label, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        )
    return DtypeResult(
        label,
        step_ms=1000 * statistics.median(r.wall_s for r in records),
        eval_loss=eval_loss,
        skipped=sum(r.found_inf for r in records),
    )


def fp16_rows(device) -> tuple[str, ...]:
    """The fp16 paths worth timing on ``device``: both on a CPU, the native one elsewhere."""
    return ("native", "emulated") if device.type == "cpu" else ("native",)


def fp16_verdict(auto: str, reason: str, results: dict[str, DtypeResult]) -> list[str]:
    """Which fp16 path runs take (``--fp16 auto``) and why, checked against the measured times."""
    lines = [f"{auto} (auto: {reason})"]
    native, emulated = results.get("fp16-native"), results.get("fp16-emulated")
    if native is None or emulated is None:
        return lines
    if not (math.isfinite(native.step_ms) and math.isfinite(emulated.step_ms)):
        return lines
    fast, slow = (
        ("emulated", "native") if emulated.step_ms <= native.step_ms else ("native", "emulated")
    )
    ratio = results[f"fp16-{slow}"].step_ms / results[f"fp16-{fast}"].step_ms
    lines.append(
        f"measured: emulated {emulated.step_ms:.1f} ms, native {native.step_ms:.1f} ms per step; "
        f"{fast} is {ratio:.2f}x faster"
    )
    if fast != auto and ratio > 1.1:
        lines.append(
            f"here {fast} is faster for this model than auto's choice: pass --fp16 {fast} "
            f"(or fp16: {fast} in an env spec)"
        )
    return lines


def recommend(
    info: dict[str, Any], results: dict[str, DtypeResult], fp16_path: str = "native"
) -> list[str]:
    """Advice lines: bf16 where the hardware has it and the model tolerates it, else fp16 + a scaler.

    ``results`` holds ``fp32``, ``bf16`` and ``fp16-PATH`` for each fp16 path timed;
    ``fp16_path`` is the one runs take.
    """
    fp32, bf16, fp16 = results["fp32"], results["bf16"], results[f"fp16-{fp16_path}"]
    scaler_hint = "fp16 with a loss scaler: autoscale.get_scaler('torch'), or a policy from `autoscale search`"
    lines = []
    drift = (
        abs(bf16.eval_loss - fp32.eval_loss) / abs(fp32.eval_loss) if fp32.eval_loss else math.nan
    )
    if not info["bf16_ok"] or bf16.error:
        lines.append(f"no bf16 on this device: use {scaler_hint}")
    elif not drift <= TOLERANCE:
        lines.append(
            f"bf16 moves this model's held-out loss by {100 * drift:.1f}% (> {100 * TOLERANCE:.0f}%): use {scaler_hint}"
        )
    else:
        lines.append(
            f"use bf16 autocast (torch.autocast(..., dtype=torch.bfloat16)): fp32's exponent range, no loss scaler "
            f"needed (held-out loss within {100 * drift:.2f}% of fp32)"
        )
        if info.get("fp16_native", True) and fp16.step_ms < 0.8 * bf16.step_ms:
            lines.append(
                f"fp16 is {bf16.step_ms / fp16.step_ms:.1f}x faster than bf16 here: for throughput, {scaler_hint}"
            )
    if info.get("busy"):
        lines.append(
            f"the CPU is busy ({info['busy']}): torch's threads contend and small models can run many "
            f"times slower; try OMP_NUM_THREADS=1 (or torch.set_num_threads(1))"
        )
    if (
        not info.get("fp16_native", True)
        and math.isfinite(fp16.step_ms)
        and math.isfinite(fp32.step_ms)
    ):
        lines.append(
            f"no fp16 matrix instructions here: an fp16 step takes {fp16.step_ms / fp32.step_ms:.1f}x the "
            f"fp32 step time ({fp16_path} path): fp16 runs here study loss scaling, not speed"
        )
    return lines


class DoctorCommand(Command):
    """Report the device, its fp16/bf16 support, measured step speeds, and a recommendation."""

    epilog = """examples:
  autoscale doctor
  autoscale doctor --model gpt2 --steps 3 --json doctor.json
"""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--model",
            "--workload",
            dest="model",
            default="gpt2-tiny",
            help="model to time (default gpt2-tiny); or a workload module:factory",
        )
        parser.add_argument(
            "--steps", type=int, default=5, help="timed steps per dtype (default 5)"
        )
        parser.add_argument(
            "--device", default=None, help="device to check (default: cuda when present)"
        )
        parser.add_argument("--batch-size", type=int, default=4)
        parser.add_argument("--seq-len", type=int, default=64)
        parser.add_argument("--json", metavar="PATH", help="write the findings as JSON")

    def run(self, args: argparse.Namespace) -> int:
        import torch

        from autoscale.training import TrainingRun, WorkloadSpec
        from autoscale.training.run import resolve_device

        if args.steps <= 0:
            raise ConfigError(f"--steps must be a positive number of steps, got {args.steps}")
        check_output(args.json, "--json")
        spec = WorkloadSpec(
            model=args.model,
            device=args.device,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            init="auto",
        )
        device = resolve_device(args.device)
        info = device_info(device)
        print(
            f"device:   {info['device']}: {info['name']} ({info['detail']}); torch {torch.__version__}"
        )
        print(f"fp16:     {info['fp16']}")
        print(f"bf16:     {info['bf16']}")
        shape = "" if args.model == "mlp" else f"x{args.seq_len} tokens"
        print(
            f"speed:    {args.model}, batch {args.batch_size}{shape}, median of {args.steps} steps"
        )
        plan = [("fp32", spec.replace(dtype="fp32")), ("bf16", spec.replace(dtype="bf16"))]
        plan += [(f"fp16-{p}", spec.replace(dtype="fp16", fp16=p)) for p in fp16_rows(device)]
        results = {}
        for label, row_spec in plan:
            results[label] = r = measure(row_spec, args.steps, label=label)
            text = (
                f"failed: {r.error}"
                if r.error
                else f"{r.step_ms:8.1f} ms/step   held-out loss at start {r.eval_loss:.4f}"
            )
            print(f"  {label.replace('-', ' '):<14}{text}")
        probe = TrainingRun(spec.replace(dtype="fp16", fp16="auto"), "torch")
        auto, reason = probe.fp16_path, probe.fp16_reason
        verdict = fp16_verdict(auto, reason, results)
        print("fp16 path: " + "\n          ".join(verdict))
        advice = recommend(info, results, auto)
        print("advice:   " + "\n          ".join(advice))
        if args.json:
            write_json(
                args.json,
                {
                    "device": info,
                    "model": args.model,
                    "results": {k: asdict(v) for k, v in results.items()},
                    "fp16_path": {"auto": auto, "reason": reason, "verdict": verdict},
                    "advice": advice,
                },
            )
        return 0
