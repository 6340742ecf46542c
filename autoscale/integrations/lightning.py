"""PyTorch Lightning: precision plugins that scale with an autoscale scaler.

``MixedPrecision("16-mixed", device, scaler=...)`` takes any GradScaler (checked on Lightning 2.6):
it scales in ``pre_backward``, runs ``scaler.unscale_`` before the ``on_before_optimizer_step`` hook
and gradient clipping, then ``scaler.step``/``scaler.update``, and checkpoints
``scaler.state_dict()`` under the plugin's class name. Passing the plugin in ``Trainer(plugins=[...])``
also bypasses the ``accelerator="cpu"`` downgrade of ``precision="16-mixed"`` to bf16, so fp16
autocast runs on CPU too.

``FSDPPrecision(precision, scaler=...)`` cannot take a scaler in Lightning 2.6: its ``__init__``
checks ``self.precision`` before setting it (a ``ValueError`` for any scaler) and then builds a
``ShardedGradScaler`` regardless. :func:`fsdp_precision_plugin` builds the plugin without one and
sets ``plugin.scaler`` afterwards. LossScaler reduces the found-inf flag over the process group
itself, so every rank skips the same steps, as ShardedGradScaler would.

Imports ``lightning.pytorch``, or ``pytorch_lightning`` when only that is installed.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from autoscale.integrations._scaler import resolve_scaler
from autoscale.scalers.base import default_device

if TYPE_CHECKING:
    from lightning.pytorch.plugins import FSDPPrecision, MixedPrecision

    from autoscale.scalers.base import LossScaler

__all__ = ["mixed_precision_plugin", "fsdp_precision_plugin"]


def _plugins():
    try:
        from lightning.pytorch import plugins
    except ImportError:  # the standalone package
        from pytorch_lightning import plugins
    return plugins


def mixed_precision_plugin(
    scaler: str | LossScaler = "torch", device: str | None = None, **overrides: Any
) -> MixedPrecision:
    """``MixedPrecision("16-mixed", device, scaler=...)`` with an autoscale scaler.

    Args:
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.base.LossScaler`.
        device: The autocast device, ``"cuda"`` or ``"cpu"``; CUDA when present, else CPU.
        **overrides: Rule keyword arguments when ``scaler`` is a name.

    Example::

        trainer = L.Trainer(max_steps=1000, plugins=[mixed_precision_plugin("deepspeed")])
    """
    device = device or default_device()
    return _plugins().MixedPrecision(
        "16-mixed", device, scaler=resolve_scaler(scaler, device, overrides)
    )


def fsdp_precision_plugin(
    scaler: str | LossScaler = "torch", device: str = "cuda", **overrides: Any
) -> FSDPPrecision:
    """``FSDPPrecision("16-mixed")`` whose scaler is an autoscale scaler, for ``strategy="fsdp"``.

    Args:
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.base.LossScaler`.
        device: Device of the scale; FSDPPrecision autocasts on ``"cuda"`` only.
        **overrides: Rule keyword arguments when ``scaler`` is a name.

    Example::

        trainer = L.Trainer(strategy="fsdp", plugins=[fsdp_precision_plugin("deepspeed")])
    """
    built = resolve_scaler(scaler, device, overrides)
    with warnings.catch_warnings():  # the ShardedGradScaler built here is replaced at once
        warnings.filterwarnings(
            "ignore", message=".*GradScaler is enabled, but CUDA is not available"
        )
        plugin = _plugins().FSDPPrecision("16-mixed")
    plugin.scaler = built
    return plugin
