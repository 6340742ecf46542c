"""`TrainingRun`: the instrumented AMP training loop of one workload under one loss scaler."""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from autoscale.errors import ConfigError
from autoscale.processes import raise_if_interrupted
from autoscale.scalers.controller import FP16_MIN_NORMAL
from autoscale.scalers.scaler import LossScaler
from autoscale.training.data import (
    BatchStream,
    LowRankStream,
    MixtureStream,
    TokenStream,
    byte_tokens,
    load_text,
)
from autoscale.training.fp16 import Fp16EmulationMode, matmul_macs, resolve_fp16_path
from autoscale.training.instruments import BackwardAmaxMode, GradientCensus
from autoscale.training.models import BuiltModel, build_model
from autoscale.training.presets import is_user_workload
from autoscale.training.records import Snapshot, StepRecord
from autoscale.training.scenarios import make_scenario
from autoscale.training.scorecard import Scorecard, precision_loss_from_counts
from autoscale.training.spec import WorkloadSpec
from autoscale.training.user import UserStream, UserWorkload, build_user_workload

__all__ = ["TrainingRun", "AMP_DTYPES", "resolve_device"]

AMP_DTYPES: dict[str, torch.dtype | None] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": None,
}
# Normal minimum of the dtype the backward runs in: what precision loss is measured against.
MIN_NORMAL = {"fp16": FP16_MIN_NORMAL, "bf16": 2.0**-126, "fp32": 2.0**-126}


class TrainingRun:
    """One workload trained step by step under one loss scaler, with every step measured.

    Each :meth:`step` is the standard AMP recipe: ``zero_grad``; per micro-batch, forward under
    ``torch.autocast`` and ``scaler.scale(loss).backward()``; ``scaler.unscale_``; gradient
    clipping; ``scaler.step``; ``scaler.update``. On top of GradScaler's work (and the scaler's
    fused gradient statistics) it counts gradient elements below the dtype's normal range with a
    few whole-buffer ops (:class:`~autoscale.training.instruments.GradientCensus`) and reads them,
    with the loss, in one extra host sync per step, after ``update()``. The scenario sets the
    learning rate, the loss weight and the objective.

    Args:
        spec: The workload.
        scaler: A registered scaler name (built with ``make_scaler(name, device=...,
            collect_stats=True, **scaler_overrides)``) or a :class:`LossScaler` instance (its
            ``collect_stats`` is switched on).
        record: Also record, per step, the log2 histogram of the gradients and the max |x| over
            every fp16 tensor of the backward pass (for traces and replay; slower).
        **scaler_overrides: Keyword arguments of the scaler, when given by name.

    Attributes:
        spec, model, optimizer (AdamW; fused on CUDA), scaler, data (a BatchStream), scenario,
        device, step_index (steps taken), records (a :class:`StepRecord` per step since
        construction or the last :meth:`restore`), built (what the model is and where it came
        from), scaler_spec (``scaler.spec()`` as built, before training moved the scale),
        fp16_path (``"native"`` or ``"emulated"`` for fp16 runs, see
        :mod:`autoscale.training.fp16`; None for other dtypes) and fp16_reason (why, in words).
    """

    def __init__(
        self,
        spec: WorkloadSpec,
        scaler: LossScaler | str = "torch",
        *,
        record: bool = False,
        **scaler_overrides: Any,
    ) -> None:
        if not isinstance(spec, WorkloadSpec):
            raise ConfigError(f"TrainingRun needs a WorkloadSpec, got {type(spec).__name__}")
        self.spec = spec
        self.record = bool(record)
        self.device = resolve_device(spec.device)
        self._amp_dtype = AMP_DTYPES[spec.dtype]
        _seed_everything(spec.seed)
        # a user's workload (module:factory) brings its model, optimizer, batches and loss
        self.user: UserWorkload | None = None
        if is_user_workload(spec.model):
            if spec.scenario == "preference":
                raise ConfigError(
                    f"workload '{spec.model}': the preference scenario needs a language-model "
                    "preset or mlp; a user workload takes clean, bad-batches, small-grads, moving, drift or "
                    "token-sum"
                )
            self.user = build_user_workload(spec.model, spec.seed, self.device.type)
            self.built = BuiltModel(self.user.model, "user", "factory", spec.model)
        else:
            self.built: BuiltModel = build_model(spec)
        self.model = self.built.model.to(self.device).train()
        if self.user is not None:
            self.data = UserStream(self.user, eval_batches=spec.eval_batches, device=self.device)
        else:
            self.data = _make_data(spec, self.built, self.device)
        self.fp16_path: str | None = None
        self.fp16_reason: str | None = None
        if spec.dtype == "fp16":
            if self.user is not None:
                samples = _rows(self.data.next_batch())
                self.data.cursor = 0
            else:
                samples = spec.batch_size * (spec.seq_len if self.built.kind == "lm" else 1)
            self.fp16_path, self.fp16_reason = resolve_fp16_path(
                spec.fp16, self.device, matmul_macs(self.model, samples)
            )
        # the fp16 emulation this run's forward and backward run under (None: native or not fp16)
        self.emulator = Fp16EmulationMode() if self.fp16_path == "emulated" else None
        self.scenario = make_scenario(spec.scenario, spec.scenario_params, spec.seed)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if self.user is not None:
            self.optimizer = self.user.optimizer
        else:
            self.optimizer = torch.optim.AdamW(
                self._params, lr=spec.lr, fused=self.device.type == "cuda"
            )
        # the learning rates the scenario's factor multiplies: spec.lr, or the user's optimizer's
        # own (moved by its scheduler after each applied step)
        self._base_lrs = [
            float(g["lr"]) if self.user is not None else spec.lr
            for g in self.optimizer.param_groups
        ]
        self._checked_fp16 = spec.dtype != "fp16" or self.user is None
        self._peeked: torch.Tensor | None = None  # this step's first objective (peek_loss)
        self.scaler = self._make_scaler(scaler, scaler_overrides)
        self.scaler.grads.keep_abs = True  # its statistics' copy of |g| is the census's input
        self.scaler_spec = self.scaler.spec()  # as configured, before training moves the scale
        self.census = GradientCensus()  # the gradients' precision census, step by step
        self.step_index = 0
        self.records: list[StepRecord] = []

    def _make_scaler(self, scaler: LossScaler | str, overrides: dict[str, Any]) -> LossScaler:
        if isinstance(scaler, str):
            from autoscale.scalers import make_scaler

            return make_scaler(scaler, device=self.device.type, collect_stats=True, **overrides)
        if not isinstance(scaler, LossScaler):
            raise ConfigError(
                f"scaler must be a registered name or a LossScaler, got {type(scaler).__name__}"
            )
        if overrides:
            raise ConfigError(
                f"scaler overrides ({', '.join(overrides)}) apply only to a scaler given by name"
            )
        if not scaler.is_enabled():
            raise ConfigError(
                "TrainingRun needs an enabled scaler; for no scaling use make_scaler('static', init_scale=1)"
            )
        if scaler.device != self.device.type:
            raise ConfigError(
                f"scaler is for device '{scaler.device}' but the run is on '{self.device.type}'"
            )
        scaler.collect_stats = True
        return scaler

    # ------------------------------------------------------------------ training
    def _autocast(self):
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

    def _emulation(self):
        """Around forward and backward: fp16 products in fp32 where the fp16 path is emulated."""
        return self.emulator if self.emulator is not None else contextlib.nullcontext()

    def step(self) -> StepRecord:
        """Take one optimizer step and return its record (also appended to :attr:`records`)."""
        raise_if_interrupted()  # a Ctrl-C Python dropped (autoscale.processes.sticky_interrupt)
        start = time.perf_counter()
        spec, index = self.spec, self.step_index
        factor = self.scenario.lr_factor(index)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor
        lr = self._base_lrs[0] * factor
        weight = self.scenario.loss_weight(index) / spec.grad_accum
        self.optimizer.zero_grad(set_to_none=True)
        watch = BackwardAmaxMode() if self.record and self._amp_dtype is torch.float16 else None
        objective_sum = None
        peeked, self._peeked = self._peeked, None
        with self._emulation():  # entered first: `watch` sees each emulated op's fp16 result
            for micro in range(spec.grad_accum):
                objective = peeked if micro == 0 and peeked is not None else self._forward(micro)
                with watch if watch is not None else contextlib.nullcontext():
                    self.scaler.scale(objective if weight == 1.0 else objective * weight).backward()
                value = objective.detach().float().reshape(1)
                objective_sum = value if objective_sum is None else objective_sum + value
        self.scaler.unscale_(self.optimizer)
        flat = self.scaler.grads.grad_abs(
            self.optimizer, self.scaler.steps
        )  # the scaler's copy, when it made one
        if flat is not None:
            self.census.adopt(flat)
        else:
            self.census.load([p.grad for p in self._params if p.grad is not None])
        extras = [objective_sum / spec.grad_accum]
        if self.record:
            extras.append(self.census.log2_histogram())
            if watch is not None and watch.amax is not None:
                extras.append(watch.amax.reshape(1))
        if spec.clip is not None:
            norm = self.scaler.grads.grad_norm(
                self.optimizer, self.scaler.steps
            )  # from the statistics' pass, if it ran
            if norm is None:
                torch.nn.utils.clip_grad_norm_(self._params, spec.clip)
            else:  # clip_grad_norm_'s own arithmetic, on that norm
                coef = torch.clamp(spec.clip / (norm + 1e-6), max=1.0)
                torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coef)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # precision lost at the scale the step used (a guard may have lowered the one set)
        used = self.scaler.last_stats.scale
        extras.insert(1, self.census.underflow_counts(used, MIN_NORMAL[spec.dtype]))
        if self.user is not None and self.user.lr_scheduler is not None:
            self._schedule()
        # The one extra host sync, after update(): where the scaler syncs with fused optimizers.
        host = torch.cat([e.to(self.device, torch.float64) for e in extras]).tolist()
        stats = self.scaler.last_stats
        hist = amax = None
        if self.record:
            counts = host[3:83]
            total = math.fsum(counts)
            hist = tuple(c / total for c in counts) if total > 0 else None
            if len(host) > 83:
                amax = host[83] if math.isfinite(host[83]) else math.inf
        loss = host[0]
        record = StepRecord(
            step=index,
            scale=stats.scale,
            found_inf=stats.found_inf,
            loss=loss,
            loss_nonfinite=not math.isfinite(loss),
            grad_amax=stats.grad_amax,
            grad_rms=stats.grad_rms,
            precision_loss=precision_loss_from_counts(host[1], host[2], stats.found_inf),
            lr=lr,
            wall_s=time.perf_counter() - start,
            stats=stats,
            grad_log2_hist=hist,
            backward_amax=amax,
        )
        self.step_index += 1
        self.records.append(record)
        return record

    def _forward(self, micro: int) -> torch.Tensor:
        """The objective of micro-batch ``micro`` of this step (the forward pass). The first
        forward of a user's workload checks that autocast runs some op in fp16 (a model it runs
        wholly in fp32 has nothing for a loss scale to do)."""
        batch, index, check = self.data.next_batch(), self.step_index, not self._checked_fp16
        seen = BackwardAmaxMode(torch.float16) if check else contextlib.nullcontext()
        with seen, self._autocast():
            objective = self.scenario.objective(self.data, self.model, batch, index, micro)
        if check and seen.amax is None:
            raise ConfigError(
                f"workload '{self.spec.model}': its model ran no op in fp16 under autocast, so "
                "there is nothing to scale (autocast runs matmuls, convolutions and linear layers "
                "in fp16; check that the forward uses them, and that the model is float32)"
            )
        self._checked_fp16 = True
        return objective

    def peek_loss(self) -> float:
        """The loss the scaler sees first in the next :meth:`step` (its first micro-batch's, as
        weighted), from that step's forward pass run now (:meth:`step` continues from it): what
        an agent acting at scale time reads before it picks the step's scale."""
        if self._peeked is None:
            with self._emulation():
                self._peeked = self._forward(0)
        weight = self.scenario.loss_weight(self.step_index) / self.spec.grad_accum
        return float(self._peeked.detach() * weight if weight != 1.0 else self._peeked.detach())

    def _schedule(self) -> None:
        """Step the user's scheduler after an applied step (a skipped one leaves it), from the
        learning rates it set, then keep what it sets as the scenario's base."""
        if self.scaler.step_was_skipped:
            return
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base
        self.user.lr_scheduler.step()
        self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]

    def run(
        self,
        steps: int,
        *,
        progress: bool = False,
        callback: Callable[[StepRecord], Any] | None = None,
    ) -> Scorecard:
        """Take ``steps`` steps and score them.

        Args:
            steps: Number of steps (> 0).
            progress: Show a tqdm progress bar (on stderr).
            callback: Called with each :class:`StepRecord`; returning ``False`` stops early.

        Returns:
            The :class:`Scorecard` of the steps taken by this call.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"steps must be a positive integer, got {steps!r}")
        from autoscale.progress import progress_bar

        first, skipped = len(self.records), 0
        with progress_bar(steps, progress, unit="step", dynamic_ncols=True) as bar:
            for _ in range(steps):
                rec = self.step()
                skipped += rec.found_inf
                if progress:
                    bar.set_postfix(
                        scale=f"2^{math.log2(rec.scale):.1f}",
                        loss=f"{rec.loss:.4g}",
                        skipped=skipped,
                        refresh=False,
                    )
                    bar.update(1)
                if callback is not None and callback(rec) is False:
                    break
        return self.scorecard(self.records[first:])

    def scorecard(self, records: list[StepRecord] | None = None) -> Scorecard:
        """Score ``records`` (default: all of :attr:`records`) with the current eval loss."""
        records = self.records if records is None else records
        return Scorecard.from_records(
            records,
            eval_loss=self.eval_loss(),
            hit_min=self.scaler.hit_min,
            wall_s=math.fsum(r.wall_s for r in records),
            params_finite=self.params_finite(),
        )

    def eval_loss(self) -> float:
        """Mean held-out loss over ``spec.eval_batches`` fixed batches (no grad, same autocast dtype).

        The model is in eval mode meanwhile, so no random numbers are drawn.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            if self.user is not None and self.user.eval is not None:
                with torch.no_grad(), self._emulation(), self._autocast():
                    value = self.user.eval(self.model)
                return float(value.item() if isinstance(value, torch.Tensor) else value)
            with torch.no_grad(), self._emulation(), self._autocast():
                losses = [
                    self.scenario.eval_objective(self.data, self.model, b).float()
                    for b in self.data.eval_batches()
                ]
            return float(torch.stack(losses).mean())
        finally:
            self.model.train(was_training)

    def params_finite(self) -> bool:
        """Whether every parameter is finite."""
        with torch.no_grad():
            norms = torch._foreach_norm(self._params, math.inf)
            return bool(torch.stack([n.float() for n in norms]).isfinite().all())

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> Snapshot:
        """Copy, in memory, everything that decides how training continues."""
        if self._peeked is not None:
            raise RuntimeError("snapshot() between peek_loss() and step(): take the step first")
        return Snapshot(
            step_index=self.step_index,
            model={k: v.detach().clone() for k, v in self.model.state_dict().items()},
            optimizer=copy.deepcopy(self.optimizer.state_dict()),
            scaler=copy.deepcopy(self.scaler.state_dict()),
            scaler_last_stats=self.scaler.last_stats,
            rng=_rng_state(self.device),
            data=self.data.state_dict(),
            scenario=copy.deepcopy(self.scenario.state_dict()),
            records=tuple(self.records),
            extra=self._extra_state(),
        )

    def restore(self, snap: Snapshot) -> None:
        """Return to ``snap``: continuing is then bit-identical (on CPU) to continuing back then.

        :attr:`records` becomes the records the run had when the snapshot was taken.
        """
        self._peeked = None  # a forward of a step that is no longer next
        self.model.load_state_dict(snap.model)
        self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        self.scaler.load_state_dict(copy.deepcopy(snap.scaler))
        self.scaler.last_stats = snap.scaler_last_stats
        _set_rng_state(snap.rng)
        self.data.load_state_dict(snap.data)
        self.scenario.load_state_dict(copy.deepcopy(snap.scenario))
        self.step_index = snap.step_index
        self.records = list(snap.records)
        extra = snap.extra or {}
        if "base_lrs" in extra:
            self._base_lrs = list(extra["base_lrs"])
        if "lr_scheduler" in extra:
            self.user.lr_scheduler.load_state_dict(copy.deepcopy(extra["lr_scheduler"]))

    def _extra_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"base_lrs": list(self._base_lrs)}
        sched = self.user.lr_scheduler if self.user is not None else None
        if sched is not None and hasattr(sched, "state_dict"):
            out["lr_scheduler"] = copy.deepcopy(sched.state_dict())
        return out

    def __repr__(self) -> str:
        return f"TrainingRun(model={self.spec.model!r}, scenario={self.spec.scenario!r}, scaler={self.scaler.name!r}, step={self.step_index})"


def resolve_device(name: str | None) -> torch.device:
    """``name`` as a torch.device (None: CUDA when present); ConfigError for CUDA without CUDA."""
    from autoscale.scalers.scaler import default_device

    device = torch.device(name or default_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device '{name}' asked for but CUDA is not available here; use --device cpu"
        )
    return device


def _make_data(spec: WorkloadSpec, built: BuiltModel, device: torch.device) -> BatchStream:
    common = {
        "batch_size": spec.batch_size,
        "seed": spec.seed,
        "eval_batches": spec.eval_batches,
        "device": device,
    }
    if built.kind == "classifier":
        return MixtureStream(**common)
    if built.kind == "autoencoder":
        return LowRankStream(features=built.config["features"], **common)
    text = load_text(spec.data)
    source = f"'{spec.data}'" if spec.data else "pydoc_data.topics"
    if built.tokenizer is not None:
        built.tokenizer.model_max_length = int(1e12)  # one long text, cut into windows here
        tokens = torch.tensor(
            built.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long
        )
    else:
        tokens = byte_tokens(text)
    return TokenStream(
        tokens, seq_len=spec.seq_len, vocab_size=built.vocab_size, source=source, **common
    )


def _rows(batch: Any) -> int:
    """The leading dimension of a batch's first tensor (1 if it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, dict):
        for v in values:
            if isinstance(v, torch.Tensor):
                return int(v.shape[0]) if v.dim() else 1
    return 1


def _seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state(device: torch.device) -> dict[str, Any]:
    import numpy as np

    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
