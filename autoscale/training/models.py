"""Model presets and loading of local Hugging Face causal LMs (never downloads anything).

Presets: ``gpt2`` (GPT-2 124M architecture), ``gpt2-medium`` (355M), ``gpt2-tiny`` (2 layers,
width 64, 2 heads, byte vocabulary: the CPU default), ``mlp`` (a small classifier on a fixed
Gaussian mixture, see :class:`~autoscale.training.data.MixtureStream`) and ``autoencoder`` (an MLP
autoencoder on fixed low-rank vectors, :class:`~autoscale.training.data.LowRankStream`). Any other name is a Hugging
Face causal-LM id or a local model folder, usable when its files are on this machine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoscale.errors import ConfigError
from autoscale.training.presets import PRESETS, ModelPreset

if TYPE_CHECKING:
    from autoscale.training.spec import WorkloadSpec

__all__ = [
    "BuiltModel",
    "MLPClassifier",
    "AutoEncoder",
    "build_model",
]

logger = logging.getLogger("autoscale")


class MLPClassifier(nn.Module):
    """``features -> hidden -> hidden -> classes`` with GELU activations."""

    def __init__(self, features: int = 32, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class AutoEncoder(nn.Module):
    """``features -> hidden -> code -> hidden -> features`` with GELU activations."""

    def __init__(self, features: int = 64, hidden: int = 128, code: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, code)
        )
        self.decoder = nn.Sequential(
            nn.Linear(code, hidden), nn.GELU(), nn.Linear(hidden, features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


_SMALL = {"classifier": MLPClassifier, "autoencoder": AutoEncoder}


@dataclass
class BuiltModel:
    """A model ready to train, with what the data pipeline needs to know about it."""

    model: nn.Module
    kind: str  # "lm" or "classifier"
    init: str  # "pretrained" or "random"
    source: str  # where the weights/config came from
    tokenizer: Any | None = None
    vocab_size: int = 0
    max_positions: int | None = None
    config: dict[str, Any] = field(default_factory=dict)


def build_model(spec: WorkloadSpec) -> BuiltModel:
    """Build (or load from local files) the model of ``spec``, in float32 on the CPU.

    Raises:
        ConfigError: pretrained weights asked for but not on this machine, a Hub model whose files
            are not local, or a sequence length beyond the model's positions.
    """
    preset = PRESETS.get(spec.model)
    if preset is not None and preset.kind in _SMALL:
        if spec.init == "pretrained":
            raise ConfigError(
                f"model '{spec.model}' has no pretrained weights; use --init random (or auto)"
            )
        return BuiltModel(
            _SMALL[preset.kind](**preset.config),
            preset.kind,
            "random",
            f"preset {preset.name}",
            config=dict(preset.config),
        )
    built = _preset_lm(preset, spec.init) if preset is not None else _hub_lm(spec.model, spec.init)
    if built.max_positions is not None and spec.seq_len > built.max_positions:
        raise ConfigError(
            f"seq_len {spec.seq_len} exceeds model '{spec.model}''s {built.max_positions} positions; lower --seq-len"
        )
    return built


_WARNED_RANDOM: set[str] = set()


def _preset_lm(preset: ModelPreset, init: str) -> BuiltModel:
    if init != "random":
        for hub_id in preset.hub_ids:
            built = _pretrained(hub_id)
            if built is not None:
                return built
        if init == "pretrained" and not preset.hub_ids:
            raise ConfigError(
                f"model '{preset.name}' has no pretrained weights; use --init random (or auto)"
            )
        if init == "pretrained":
            raise ConfigError(
                f"model '{preset.name}': no pretrained weights on this machine ({' or '.join(preset.hub_ids)}); "
                f"download them first, or pass --init random"
            )
        if preset.hub_ids and preset.name not in _WARNED_RANDOM:
            _WARNED_RANDOM.add(preset.name)  # once per process: a search builds many runs
            logger.warning(
                "autoscale: no local weights for '%s' (%s); training it from random init (--init random silences this)",
                preset.name,
                preset.hub_ids[0],
            )
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**preset.config)
    with _quiet_transformers():
        model = GPT2LMHeadModel(config)
    return _lm(model, "random", f"preset {preset.name}", None)


def _hub_lm(name: str, init: str) -> BuiltModel:
    if init != "random":
        built = _pretrained(name)
        if built is not None:
            return built
        raise ConfigError(
            f"model '{name}': no weights on this machine (nothing is downloaded at run time); download "
            f"it first, or pass --init random to build it untrained from its config (needs the config locally)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with _quiet_transformers():
            config = AutoConfig.from_pretrained(name, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model '{name}': no config on this machine to build it from ({_first_line(exc)}); "
            f"use a preset ({', '.join(PRESETS)}) or download the model first"
        ) from exc
    return _lm(model, "random", name, None)


def _pretrained(source: str) -> BuiltModel | None:
    """Load weights (and the tokenizer, if present) from local files only; None if absent."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                source, local_files_only=True, dtype=torch.float32
            )
    except (OSError, ValueError):
        return None
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None and not _usable(tokenizer, model.config.vocab_size):
        tokenizer = None  # transformers may build an empty tokenizer from the config alone
    if tokenizer is None:
        logger.warning(
            "autoscale: model '%s' has no local tokenizer; feeding it UTF-8 bytes as tokens", source
        )
    return _lm(model, "pretrained", source, tokenizer)


def _usable(tokenizer: Any, vocab_size: int) -> bool:
    ids = tokenizer("Hello world, 42.", add_special_tokens=False)["input_ids"]
    return len(ids) > 0 and max(ids) < vocab_size


def _lm(model: nn.Module, init: str, source: str, tokenizer: Any | None) -> BuiltModel:
    config = model.config
    positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None
    )
    return BuiltModel(
        model.float(),
        "lm",
        init,
        source,
        tokenizer,
        int(config.vocab_size),
        positions,
        {
            "model_type": config.model_type,
            "num_parameters": sum(p.numel() for p in model.parameters()),
        },
    )


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' info/warning chatter and progress bars while building."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
