"""The model presets, and what a model name may be: a preset, a Hugging Face causal-LM id or
local folder, or a user's ``module:factory`` workload. Torch-free, so that a workload spec checks
its model name without importing torch or the model builders
(:mod:`~autoscale.training.models`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoscale.errors import UnknownNameError, unknown_name

__all__ = [
    "REFERENCE",
    "ModelPreset",
    "PRESETS",
    "check_model_name",
    "is_user_workload",
    "list_models",
    "workload_label",
]

# a user workload: MODULE:FACTORY or path/to/file.py:FACTORY
REFERENCE = re.compile(r"^(?P<target>[^:]+):(?P<factory>[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass(frozen=True)
class ModelPreset:
    """A named model: its architecture config and the Hub ids whose local weights it can use."""

    name: str
    description: str
    kind: str  # "lm" or "classifier"
    config: dict[str, Any] = field(default_factory=dict)
    hub_ids: tuple[str, ...] = ()


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "gpt2",
            "GPT-2 124M (12 layers, width 768); pretrained when cached locally",
            "lm",
            {},
            ("openai-community/gpt2", "gpt2"),
        ),
        ModelPreset(
            "gpt2-medium",
            "GPT-2 355M (24 layers, width 1024); pretrained when cached locally",
            "lm",
            {"n_layer": 24, "n_embd": 1024, "n_head": 16},
            ("openai-community/gpt2-medium", "gpt2-medium"),
        ),
        ModelPreset(
            "gpt2-tiny",
            "GPT-2 architecture, 2 layers, width 64, 2 heads, byte vocabulary (the CPU default)",
            "lm",
            {
                "n_layer": 2,
                "n_embd": 64,
                "n_head": 2,
                "vocab_size": 256,
                "bos_token_id": 0,
                "eos_token_id": 0,
            },
        ),
        ModelPreset(
            "mlp",
            "2-hidden-layer MLP classifier (width 256) on a fixed Gaussian mixture",
            "classifier",
            {"features": 32, "hidden": 256, "classes": 10},
        ),
        ModelPreset(
            "autoencoder",
            "MLP autoencoder (64 -> 128 -> 8 -> 128 -> 64) on fixed low-rank synthetic vectors",
            "autoencoder",
            {"features": 64, "hidden": 128, "code": 8},
        ),
    )
}


def list_models() -> list[str]:
    """Names of the model presets (Hugging Face ids and local folders work too)."""
    return list(PRESETS)


def is_user_workload(name: str) -> bool:
    """Whether ``name`` is a ``module:factory`` or ``file.py:factory`` reference."""
    return isinstance(name, str) and REFERENCE.match(name) is not None


def workload_label(name: str) -> str:
    """A short name for a reference: the module's last part or the file's stem (plus the factory
    unless it is ``make``)."""
    m = REFERENCE.match(name)
    if m is None:
        return name
    target, factory = m["target"], m["factory"]
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    return stem if factory == "make" else f"{stem}-{factory}"


def check_model_name(name: str) -> None:
    """Refuse a name that is no preset, no local path, no Hub id and no ``module:factory``
    workload (with did-you-mean). A workload's module is imported when a run is built."""
    if is_user_workload(name):
        return
    if name in PRESETS or "/" in name or Path(name).expanduser().exists() or _cached_on_hub(name):
        return
    err = unknown_name("model", name, PRESETS, "autoscale run --help")
    raise UnknownNameError(
        f"{err}; a Hugging Face model id or local model folder also works when its files are on this machine"
    )


def _cached_on_hub(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # a malformed id is simply not cached
        return False
