"""`WorkloadSpec`: what to train, as a frozen, validated record that round-trips through YAML/JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autoscale.errors import ConfigError, check_keys, unknown_name
from autoscale.scalers.controller import positive_finite
from autoscale.training.presets import check_model_name

__all__ = ["WorkloadSpec", "DTYPES", "FP16_PATHS", "INITS"]

DTYPES = ("fp16", "bf16", "fp32")
#: Values of ``WorkloadSpec.fp16``: ``auto`` (emulated on a CPU without fp16 matrix
#: instructions where the model's products pay for it, native elsewhere), ``native`` (torch's
#: own fp16 kernels), ``emulated``.
FP16_PATHS = ("auto", "native", "emulated")
INITS = ("auto", "pretrained", "random")
_DTYPE_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
}


@dataclass(frozen=True)
class WorkloadSpec:
    """One training workload: model, data, scenario and the AMP settings of the loop.

    Every field is validated when the spec is built; names that are not known raise
    :class:`~autoscale.errors.UnknownNameError` with the nearest valid name. Whether a Hugging Face
    model's files are on this machine, the data path and the device are checked when a
    :class:`~autoscale.training.TrainingRun` is built, since specs travel between machines.

    Attributes:
        model: A preset (``gpt2``, ``gpt2-medium``, ``gpt2-tiny``, ``mlp``; see
            :func:`~autoscale.training.list_models`), a Hugging Face causal-LM id, or a local
            model folder.
        scenario: The failure mode to reproduce (see :func:`~autoscale.training.list_scenarios`).
        scenario_params: The scenario's knobs, e.g. ``{"every": 10}``; unknown keys are refused.
        dtype: Autocast dtype: ``fp16``, ``bf16`` or ``fp32`` (no autocast).
        fp16: How fp16 products are computed on a CPU: ``native`` (torch's fp16 kernels, scalar
            loops without AVX512-FP16/AMX-FP16), ``emulated`` (fp32 products rounded to fp16, the
            same numerics as tensor cores; see :mod:`autoscale.training.fp16`) or ``auto``
            (emulated on a CPU without fp16 matrix instructions when the model's products are
            large enough to pay for it). CUDA always runs natively; other dtypes ignore it.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; None picks CUDA when present.
        batch_size: Sequences (or examples, for ``mlp``) per micro-batch.
        seq_len: Tokens per sequence (ignored by ``mlp``).
        lr: Base learning rate of AdamW (scenarios may schedule a multiple of it).
        grad_accum: Micro-batches per optimizer step.
        clip: Max gradient norm, applied after ``scaler.unscale_``; None disables clipping.
        data: A text file or a folder of text files; None uses CPython's ``pydoc_data.topics``.
        init: ``pretrained`` (local weights required), ``random`` (from the config), or ``auto``:
            pretrained when the weights are on this machine, else random for the presets (with a
            one-line notice for ``gpt2``/``gpt2-medium``) and an error for other models.
        seed: Seeds the model init, the batch order, dropout and the scenario.
        eval_batches: Held-out batches averaged by ``TrainingRun.eval_loss()``.
    """

    model: str = "gpt2-tiny"
    scenario: str = "clean"
    scenario_params: dict[str, Any] = field(default_factory=dict)
    dtype: str = "fp16"
    fp16: str = "auto"
    device: str | None = None
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 1e-3
    grad_accum: int = 1
    clip: float | None = 1.0
    data: str | None = None
    init: str = "auto"
    seed: int = 0
    eval_batches: int = 4

    def __post_init__(self) -> None:
        from autoscale.training.scenarios import scenario_class

        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty name or path, got {self.model!r}")
        check_model_name(self.model)
        cls = scenario_class(self.scenario)
        object.__setattr__(self, "scenario_params", cls.check_params(self.scenario_params))
        dtype = _DTYPE_ALIASES.get(str(self.dtype), self.dtype)
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.fp16 not in FP16_PATHS:
            raise unknown_name("fp16 path", str(self.fp16), FP16_PATHS, "autoscale run --help")
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(
                    f"device {self.device!r} is not a torch device (try cpu or cuda)"
                ) from exc
        for name in ("batch_size", "seq_len", "grad_accum", "eval_batches"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2 tokens, got {self.seq_len}")
        object.__setattr__(self, "lr", positive_finite("lr", self.lr))
        if self.clip is not None:
            object.__setattr__(self, "clip", positive_finite("clip", self.clip))
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {', '.join(INITS)}, got {self.init!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.data is not None and not isinstance(self.data, str):
            object.__setattr__(self, "data", str(self.data))

    def __hash__(self) -> int:  # the params dict is unhashable; its sorted items are not
        return hash(
            tuple(
                (k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                for k, v in self.to_dict().items()
            )
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain primitives; ``WorkloadSpec.from_dict(spec.to_dict()) == spec``."""
        out = dataclasses.asdict(self)
        out["scenario_params"] = dict(self.scenario_params)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        """Build from :meth:`to_dict` output (or a YAML mapping); unknown keys are refused."""
        if not isinstance(d, dict):
            raise ConfigError(f"a workload spec must be a mapping, got {type(d).__name__}")
        _check_keys(d)
        return cls(**d)

    def replace(self, **changes: Any) -> WorkloadSpec:
        """A copy with ``changes`` applied (validated again)."""
        _check_keys(changes)
        return dataclasses.replace(self, **changes)


def _check_keys(d: dict[str, Any]) -> None:
    check_keys("workload spec", d, [f.name for f in dataclasses.fields(WorkloadSpec)])


def _positive_int(name: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or int(value) != value
        or value < 1
    ):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
