"""Hugging Face ``transformers.Trainer`` with an autoscale scaler.

``Trainer.__init__`` builds its Accelerator in ``create_accelerator_and_postprocess`` (checked on
transformers 5.25), before anything is prepared; :class:`AutoscaleTrainerMixin` overrides that method
to install the scaler on the new accelerator with
:func:`autoscale.integrations.accelerate.install_scaler`. Everything else is the Trainer's own: it
backpropagates through ``accelerator.backward``, clips through ``accelerator.clip_grad_norm_`` (which
unscales first), steps the prepared optimizer, and checkpoints ``accelerator.scaler.state_dict()`` as
``scaler.pt``, loaded back with ``torch.load(weights_only=True)`` on resume. LossScaler's state is
primitive-only, so that round trip restores the scale, the rule's counters and its history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoscale.errors import ConfigError, missing_extra

try:
    from transformers import Trainer, TrainerCallback
except ModuleNotFoundError as exc:  # the 'hf' extra's, said in one line
    _missing = missing_extra("autoscale.integrations.trainer", exc.name or "")
    if _missing is None:
        raise
    raise _missing from None

from autoscale.integrations.accelerate import install_scaler

if TYPE_CHECKING:
    from autoscale.scalers.scaler import LossScaler

__all__ = ["AutoscaleTrainer", "AutoscaleTrainerMixin", "ScaleLogCallback", "log_scale"]


class ScaleLogCallback(TrainerCallback):
    """Adds the loss scale to the Trainer's logs: ``autoscale/scale``, ``autoscale/log2_scale``,
    ``autoscale/skipped_total``, ``autoscale/skipped_since_last_log``, ``autoscale/grad_amax``
    and ``autoscale/underflow`` (share of gradient elements below fp16's range, from the latest
    gradient histogram), every ``logging_steps``, wherever ``report_to`` sends them.

    It finds the scaler on the prepared optimizer (any GradScaler autoscale built: the
    AutoscaleTrainer's, or the Trainer's own under ``autoscale wrap``). The Trainer hands one
    logs dict to its callbacks in order, reporting integrations first: add this one with
    :func:`log_scale`, which puts it before them.
    """

    def __init__(self, hist_every: int = 8) -> None:
        self.hist_every = hist_every
        self.watch: Any = None
        self.sink: Any = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        from autoscale.observe import watch_scaler
        from autoscale.observe.live import LatestSink
        from autoscale.scalers.scaler import LossScaler

        scaler = getattr(optimizer, "scaler", None)
        if isinstance(scaler, LossScaler) and self.watch is None:
            self.sink = LatestSink()
            self.watch = watch_scaler(scaler, hist_every=self.hist_every)
            self.watch.sinks.append(self.sink)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.watch is None or logs is None or "loss" not in logs:
            return
        self.watch.flush()
        metrics = {f"autoscale/{k}": v for k, v in self.sink.take().items()}
        logs.update(metrics)  # what the reporting callbacks after this one send
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)  # the Trainer kept a copy before on_log

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.close()
            self.watch = None


def log_scale(trainer: Trainer, hist_every: int = 8) -> ScaleLogCallback:
    """Put a :class:`ScaleLogCallback` first among ``trainer``'s callbacks; return it."""
    callback = ScaleLogCallback(hist_every)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


class AutoscaleTrainerMixin:
    """Mix into any ``Trainer`` subclass (``class MyTrainer(AutoscaleTrainerMixin, SFTTrainer)``).

    Args:
        scaler: A registered scaler name or a built :class:`~autoscale.scalers.scaler.LossScaler`.
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
