"""Hugging Face ``transformers.Trainer`` with an autoscale scaler.

``Trainer.__init__`` builds its Accelerator in ``create_accelerator_and_postprocess`` (checked on
transformers 5.24), before anything is prepared; :class:`AutoscaleTrainerMixin` overrides that method
to install the scaler on the new accelerator with
:func:`autoscale.integrations.accelerate.install_scaler`. Everything else is the Trainer's own: it
backpropagates through ``accelerator.backward``, clips through ``accelerator.clip_grad_norm_`` (which
unscales first), steps the prepared optimizer, and checkpoints ``accelerator.scaler.state_dict()`` as
``scaler.pt``, loaded back with ``torch.load(weights_only=True)`` on resume. LossScaler's state is
primitive-only, so that round trip restores the scale, the rule's counters and its history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import Trainer

from autoscale.errors import ConfigError
from autoscale.integrations.accelerate import install_scaler

if TYPE_CHECKING:
    from autoscale.scalers.base import LossScaler

__all__ = ["AutoscaleTrainer", "AutoscaleTrainerMixin"]


class AutoscaleTrainerMixin:
    """Mix into any ``Trainer`` subclass (``class MyTrainer(AutoscaleTrainerMixin, SFTTrainer)``).

    Args:
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.base.LossScaler`.
        scaler_overrides: Rule keyword arguments when ``scaler`` is a name.
        *args, **kwargs: Passed on to the Trainer; ``TrainingArguments(fp16=True)`` is required.
    """

    def __init__(
        self,
        *args: Any,
        scaler: str | LossScaler = "torch",
        scaler_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before Trainer.__init__, which calls create_accelerator_and_postprocess.
        self.autoscale_scaler = scaler
        self.autoscale_overrides = dict(scaler_overrides or {})
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled:
            raise ConfigError(
                f"{type(self).__name__} cannot install a scaler under DeepSpeed, which scales the loss "
                "itself; drop scaler= and pass TrainingArguments(deepspeed="
                "autoscale.integrations.deepspeed.deepspeed_config(NAME)) to a plain Trainer"
            )
        if self.accelerator.mixed_precision != "fp16":
            raise ConfigError(
                f"{type(self).__name__} needs TrainingArguments(fp16=True), got mixed precision "
                f"'{self.accelerator.mixed_precision}'; only fp16 training uses a loss scale"
            )
        install_scaler(self.accelerator, self.autoscale_scaler, **self.autoscale_overrides)

    @property
    def loss_scaler(self) -> LossScaler:
        """The scaler in use (``trainer.accelerator.scaler``)."""
        return self.accelerator.scaler


class AutoscaleTrainer(AutoscaleTrainerMixin, Trainer):
    """``transformers.Trainer`` whose fp16 loss scale follows an autoscale rule or policy.

    Example::

        args = TrainingArguments("out", fp16=True, max_grad_norm=1.0)
        trainer = AutoscaleTrainer(model=model, args=args, train_dataset=ds, scaler="deepspeed")
        trainer.train()  # trainer.loss_scaler.steps, .skipped, .get_scale()
    """
