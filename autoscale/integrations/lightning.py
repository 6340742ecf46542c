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
sets ``plugin.scaler`` afterwards, as a :class:`~autoscale.scalers.sharded.ShardedLossScaler`: the
rule with ShardedGradScaler's semantics (fp16 losses and gradients, CPU-offloaded ones, the
found-inf flag all-reduced), so every rank skips the same steps.

Imports ``lightning.pytorch``, or ``pytorch_lightning`` when only that is installed.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from autoscale.errors import missing_extra
from autoscale.integrations._scaler import resolve_scaler
from autoscale.scalers.scaler import default_device

if TYPE_CHECKING:
    from lightning.pytorch.plugins import FSDPPrecision, MixedPrecision

    from autoscale.scalers.scaler import LossScaler

__all__ = ["ScaleMonitor", "mixed_precision_plugin", "fsdp_precision_plugin"]


def _from_lightning(name: str) -> Any:
    """``lightning.pytorch``'s ``name``, or ``pytorch_lightning``'s where only the standalone
    package is installed; neither: the error naming the extra (a missing dependency of an
    installed one is raised as it is)."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return getattr(importlib.import_module(package), name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != package.split(".")[0]:
                raise
    raise missing_extra("autoscale.integrations.lightning", "lightning")


def _callback_base():
    return _from_lightning("Callback")


class ScaleMonitor(_callback_base()):
    """Logs the loss scale with the LightningModule's own ``log``, as ``LearningRateMonitor``
    logs the learning rate: ``autoscale/scale``, ``autoscale/log2_scale``,
    ``autoscale/skipped_total``, ``autoscale/skipped_since_last_log``, ``autoscale/grad_amax``
    and ``autoscale/underflow`` every ``log_every_n_steps``, to whatever logger the Trainer
    has. Finds the scaler on the precision plugin (an autoscale one, or torch's replaced by
    ``autoscale wrap``).

    Example::

        trainer = L.Trainer(plugins=[mixed_precision_plugin("auto")], callbacks=[ScaleMonitor()])
    """

    def __init__(self, hist_every: int = 8) -> None:
        self.hist_every = hist_every
        self.watch: Any = None
        self.sink: Any = None

    def on_train_start(self, trainer, pl_module) -> None:
        from autoscale.observe import watch_scaler
        from autoscale.observe.live import LatestSink
        from autoscale.scalers.scaler import LossScaler

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if isinstance(scaler, LossScaler) and self.watch is None:
            self.sink = LatestSink()
            self.watch = watch_scaler(scaler, hist_every=self.hist_every)
            self.watch.sinks.append(self.sink)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.watch is None or trainer.global_step % trainer.log_every_n_steps:
            return
        self.watch.flush()
        metrics = {f"autoscale/{k}": v for k, v in self.sink.take().items()}
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None


def _plugins():
    return _from_lightning("plugins")


def mixed_precision_plugin(
    scaler: str | LossScaler = "torch", device: str | None = None, **overrides: Any
) -> MixedPrecision:
    """``MixedPrecision("16-mixed", device, scaler=...)`` with an autoscale scaler.

    Args:
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.scaler.LossScaler`.
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
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.scaler.LossScaler`.
        device: Device of the scale; FSDPPrecision autocasts on ``"cuda"`` only.
        **overrides: Rule keyword arguments when ``scaler`` is a name.

    Example::

        trainer = L.Trainer(strategy="fsdp", plugins=[fsdp_precision_plugin("deepspeed")])
    """
    from autoscale.scalers.sharded import as_sharded

    built = as_sharded(resolve_scaler(scaler, device, overrides))
    with warnings.catch_warnings():  # the ShardedGradScaler built here is replaced at once
        warnings.filterwarnings(
            "ignore", message=".*GradScaler is enabled, but CUDA is not available"
        )
        plugin = _plugins().FSDPPrecision("16-mixed")
    plugin.scaler = built
    return plugin
