"""Tiny models, data and probes shared by the integration tests.

Every test runs real fp16 autocast steps on CPU through the framework, then checks three things:
the autoscale scaler did the steps (its counters moved), the forward pass ran in fp16 (a hook sees
float16 activations), and clipping saw unscaled gradients: the norm ``clip_grad_norm_`` measured
equals the one the scaler computed from the gradients it had just unscaled
(``grad_rms * sqrt(n)`` with ``collect_stats=True``). With a scale of 2^12, gradients clipped
before unscaling would measure 4096 times that.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from autoscale.scalers import LossScaler, StepStats

SCALE = 2.0**12
# the "torch" rule made to grow once in 3 clean steps, with the statistics the clip check reads
FAST_TORCH = {"init_scale": SCALE, "growth_interval": 2, "collect_stats": True}
TEXT = (
    "Loss scaling multiplies the loss before the backward pass so that small fp16 gradients do "
    "not flush to zero, then divides the gradients by the same factor before the optimizer step. "
)


class ClipSpy:
    """Wraps ``clip_grad_norm_`` and keeps the total norm (before clipping) of each call."""

    def __init__(self, real: Callable[..., torch.Tensor]) -> None:
        self.real = real
        self.norms: list[float] = []

    def __call__(self, parameters, max_norm, *args, **kwargs) -> torch.Tensor:
        norm = self.real(parameters, max_norm, *args, **kwargs)
        self.norms.append(float(norm))
        return norm


def assert_clipped_unscaled(norms: list[float], stats: list[StepStats], n_params: int) -> None:
    """Each clip saw the unscaled gradients the scaler measured at that step."""
    assert norms and len(norms) == len(stats), (norms, stats)
    for norm, st in zip(norms, stats):
        unscaled = st.grad_rms * math.sqrt(n_params)
        assert norm == pytest.approx(unscaled, rel=1e-3), (
            f"clip_grad_norm_ saw a norm of {norm:g}, the unscaled gradients have {unscaled:g} (scale {st.scale:g})"
        )


def assert_three_clean_fp16_steps(
    scaler: LossScaler,
    dtypes: list[torch.dtype],
    clip_norms: list[float],
    stats: list[StepStats],
    model: torch.nn.Module,
) -> None:
    """What 3 steps with FAST_TORCH leave: fp16 forwards, the scaler's counters, one growth, and
    clipping on unscaled gradients."""
    assert dtypes == [torch.float16] * 3
    assert (scaler.steps, scaler.skipped) == (3, 0)
    assert scaler.get_scale() == SCALE * 2  # grown after growth_interval=2 clean steps
    assert_clipped_unscaled(clip_norms, stats, n_params(model))


def record_output_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    """The dtype of every output ``module`` produces from now on."""
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def tiny_mlp(seed: int = 0) -> torch.nn.Sequential:
    """1,612 parameters; fp32 weights, autocast runs the matmuls in fp16."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def regression_batches(
    n: int, batch: int = 8, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)
    ]


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT-2 of width 64 over byte tokens, built from its config (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    )


class ByteDataset(torch.utils.data.Dataset):
    """``n`` sequences of ``length`` UTF-8 bytes of TEXT, as causal-LM examples."""

    def __init__(self, n: int = 16, length: int = 64) -> None:
        data = (TEXT * (n * length // len(TEXT) + 1)).encode()[: n * length]
        self.ids = torch.tensor(list(data), dtype=torch.long).view(n, length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def trainer_args(out, max_steps: int, **kw):
    """HF TrainingArguments of the Trainer tests: fp16 on CPU, a checkpoint every 2 steps."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        fp16=True,
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **kw,
    )


def lightning_trainer(plugin, max_steps: int, **kw):
    """A quiet one-device CPU Lightning Trainer with ``plugin`` and no checkpoints of its own."""
    import lightning.pytorch as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )
