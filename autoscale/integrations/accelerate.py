"""Hugging Face Accelerate: put an autoscale scaler where ``Accelerator`` keeps its GradScaler.

``Accelerator`` builds its GradScaler in ``__init__`` (``accelerator.scaler``) and hands that object
to every optimizer that ``prepare`` wraps (``AcceleratedOptimizer.scaler``). ``backward`` then calls
``accelerator.scaler.scale(loss).backward()``, ``clip_grad_norm_`` calls ``unscale_gradients`` (which
runs ``scaler.unscale_`` when ``native_amp`` and ``mixed_precision == "fp16"``) and the prepared
optimizer's ``step`` calls ``scaler.step`` and ``scaler.update``. So the scaler must be replaced
between ``Accelerator(...)`` and ``prepare``: after it, the prepared optimizers keep the old scaler
and nothing says so. :func:`install_scaler` refuses then.

CPU: Accelerate (checked on 1.16) accepts ``mixed_precision="fp16"`` on a CPU accelerator but sets
``native_amp = False`` and creates no scaler, so nothing is autocast and nothing is scaled.
:func:`install_scaler` sets ``native_amp = True``, which turns on Accelerate's own fp16 path: its
``prepare`` wraps the model's forward in ``torch.autocast("cpu", dtype=torch.float16)`` and its
``clip_grad_norm_`` unscales first, on torch's CPU autocast and CPU GradScaler kernels.

Under FSDP the scaler replaces Accelerate's ``ShardedGradScaler`` (FSDP1, as a
:class:`~autoscale.scalers.sharded.ShardedLossScaler` with its semantics) or ``GradScaler`` (FSDP2);
either reduces the found-inf flag over the process group, so every rank skips the same steps. DeepSpeed and Megatron-LM scale inside their engines: use
:func:`autoscale.integrations.deepspeed.deepspeed_config` there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoscale.errors import ConfigError, missing_extra
from autoscale.integrations._scaler import resolve_scaler

if TYPE_CHECKING:
    from accelerate import Accelerator

    from autoscale.scalers.scaler import LossScaler

__all__ = ["install_scaler", "make_accelerator"]


def install_scaler(
    accelerator: Accelerator, scaler: str | LossScaler = "torch", **overrides: Any
) -> LossScaler:
    """Make ``accelerator`` scale fp16 losses with an autoscale scaler. Call it before ``prepare``.

    Args:
        accelerator: An ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``, on which
            ``prepare`` has not been called yet.
        scaler: A registered scaler name (``"torch"``, ``"deepspeed"``, an exported policy, ...) or a
            built :class:`~autoscale.scalers.scaler.LossScaler`.
        **overrides: Keyword arguments of the rule when ``scaler`` is a name (``init_scale``, ...).

    Returns:
        The installed scaler (also ``accelerator.scaler``); ``accelerator.save_state`` and
        ``load_state`` save and restore it with the rest of the training state.

    Raises:
        ConfigError: ``prepare`` already ran, the accelerator is not fp16, DeepSpeed/Megatron-LM own
            the loss scale, or ``GradScalerKwargs`` configured the scaler this one replaces.
    """
    from accelerate.utils import DistributedType

    mixed = accelerator.mixed_precision
    if mixed != "fp16":
        raise ConfigError(
            f"install_scaler needs Accelerator(mixed_precision='fp16'), got mixed_precision='{mixed}'; "
            "only fp16 training uses a loss scale (bf16 has float32's range)"
        )
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ConfigError(
            f"{accelerator.distributed_type.value} scales the loss inside its own engine, so an "
            "Accelerator scaler is never used; put the rule in the DeepSpeed config instead: "
            "autoscale.integrations.deepspeed.deepspeed_config(NAME)"
        )
    prepared = len(accelerator._optimizers)
    if prepared:
        raise ConfigError(
            f"install_scaler must run before accelerator.prepare(...): {prepared} prepared optimizer(s) "
            "already hold the old scaler, so their gradients would stay scaled; call install_scaler "
            "right after Accelerator(...), or accelerator.free_memory() and prepare again"
        )
    if accelerator._models and not accelerator.native_amp:
        raise ConfigError(
            f"install_scaler must run before accelerator.prepare(...): {len(accelerator._models)} model(s) "
            f"were prepared without fp16 autocast (Accelerate disables it on '{accelerator.device.type}'); "
            "call install_scaler right after Accelerator(...)"
        )
    handler = (
        accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
    )
    if handler:
        raise ConfigError(
            f"GradScalerKwargs({', '.join(f'{k}={v!r}' for k, v in handler.items())}) configure the "
            "GradScaler that install_scaler replaces; drop them and pass the values to the rule instead: "
            "install_scaler(accelerator, 'torch', init_scale=..., growth_interval=...)"
        )
    built = resolve_scaler(scaler, accelerator.device.type, overrides)
    if _sharded(accelerator.scaler):  # FSDP1: its semantics (fp16, offloaded gradients) kept
        from autoscale.scalers.sharded import as_sharded

        built = as_sharded(built)
    accelerator.scaler = built
    # Off only where Accelerate refused fp16 itself (CPU); it gates autocast and unscale-before-clip.
    accelerator.native_amp = True
    return built


def make_accelerator(
    scaler: str | LossScaler = "torch",
    *,
    scaler_overrides: dict[str, Any] | None = None,
    **accelerator_kwargs: Any,
) -> Accelerator:
    """An ``Accelerator(mixed_precision="fp16", **accelerator_kwargs)`` that scales with ``scaler``.

    Example::

        accelerator = make_accelerator("deepspeed", scaler_overrides={"loss_scale_window": 500})
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    """
    try:
        from accelerate import Accelerator
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "accelerate":  # a dependency of it: as it is
            raise
        raise missing_extra("autoscale.integrations.make_accelerator", "accelerate") from None

    accelerator_kwargs.setdefault("mixed_precision", "fp16")
    accelerator = Accelerator(**accelerator_kwargs)
    install_scaler(accelerator, scaler, **(scaler_overrides or {}))
    return accelerator


def _sharded(scaler: Any) -> bool:
    """Whether Accelerate built FSDP1's ``ShardedGradScaler`` (without importing FSDP for it)."""
    return any(c.__name__ == "ShardedGradScaler" for c in type(scaler).__mro__)
