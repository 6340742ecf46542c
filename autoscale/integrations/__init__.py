"""Plug an autoscale scaler into a training framework (docs/design.md 9).

Each integration is optional and loads its framework only when used: ``import autoscale`` (and
``import autoscale.integrations``) imports none of accelerate, transformers or lightning.

Plain loop: ``autoscale.get_scaler("torch")`` is a ``torch.amp.GradScaler``; no integration needed.

Accelerate (install before ``prepare``)::

    from autoscale.integrations import make_accelerator  # or install_scaler(accelerator, NAME)

    accelerator = make_accelerator("deepspeed")  # Accelerator(mixed_precision="fp16") + scaler
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Hugging Face Trainer::

    from autoscale.integrations.trainer import AutoscaleTrainer

    trainer = AutoscaleTrainer(model=model, args=TrainingArguments("out", fp16=True),
                               train_dataset=ds, scaler="deepspeed")

Lightning::

    from autoscale.integrations.lightning import mixed_precision_plugin

    trainer = L.Trainer(plugins=[mixed_precision_plugin("deepspeed")])

DeepSpeed (the rule as its JSON ``fp16`` block; static and hysteresis/window rules only)::

    from autoscale.integrations.deepspeed import write_deepspeed_config

    write_deepspeed_config("deepspeed", "ds_config.json", base_config={"zero_optimization": {"stage": 2}})
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it; resolved on first access so that nothing heavy is imported here
_LAZY = {
    "install_scaler": "accelerate",
    "make_accelerator": "accelerate",
    "AutoscaleTrainer": "trainer",
    "AutoscaleTrainerMixin": "trainer",
    "mixed_precision_plugin": "lightning",
    "fsdp_precision_plugin": "lightning",
    "ScaleMonitor": "lightning",
    "ScaleLogCallback": "trainer",
    "log_scale": "trainer",
    "deepspeed_config": "deepspeed",
    "write_deepspeed_config": "deepspeed",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoscale.integrations' has no attribute '{name}'")
    return getattr(importlib.import_module(f"autoscale.integrations.{module}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
