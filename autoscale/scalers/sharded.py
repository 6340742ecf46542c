"""`ShardedLossScaler`: an autoscale scaler with FSDP's ``ShardedGradScaler`` semantics.

FSDP1 (``FullyShardedDataParallel``) is driven by ``torch.distributed.fsdp.ShardedGradScaler``,
which differs from GradScaler in three ways a sharded run relies on: the scaled loss keeps the
loss's dtype (a float16 loss of FSDP's mixed precision stays float16), gradients in float16 and on
any device are unscaled (CPU-offloaded shards, ``keep_low_precision_grads``), and the found-inf
flag is all-reduced over its process group, so that every rank skips the step that overflowed in
any rank's shard. :class:`ShardedLossScaler` takes those methods from ShardedGradScaler (it is one:
``isinstance`` holds) and the scale decision from its rule, agreed across ranks as every
:class:`~autoscale.scalers.scaler.LossScaler` agrees it. With the ``torch`` rule it reproduces
ShardedGradScaler: the same scales, skipped steps and parameters.

FSDP2 (``fully_shard``) needs none of this: it is driven by a plain GradScaler over DTensor
gradients, which every autoscale scaler reads shard by shard
(:func:`~autoscale.scalers.grad_stats.local_grad`).

This module imports ``torch.distributed.fsdp`` (seconds): ``autoscale.scalers`` does not import it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from autoscale.errors import ConfigError
from autoscale.scalers.catalog import make_scaler
from autoscale.scalers.controller import ScaleRule
from autoscale.scalers.scaler import LossScaler

__all__ = ["ShardedLossScaler", "as_sharded", "sharded_scaler"]


class _ZeroDimFlags(ShardedGradScaler):
    """ShardedGradScaler's ``unscale_`` with its found-inf flags as GradScaler's are, 0-dim
    (its own are 1-element tensors): the packed step stacks them with 0-dim statistics and
    losses when no collective reshapes them (a group of one rank)."""

    def unscale_(self, optimizer: Any) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        flags = state["found_inf_per_device"]
        state["found_inf_per_device"] = {dev: f.reshape(()) for dev, f in flags.items()}


class ShardedLossScaler(LossScaler, _ZeroDimFlags):
    """An autoscale scaler that is a ``ShardedGradScaler``: build it with :func:`sharded_scaler`.

    Class order: LossScaler's methods first (the rule's update, statistics, agreement, state),
    which call on, through ``super()``, ShardedGradScaler's ``scale`` (the loss's dtype kept) and
    ``unscale_`` (float16 and offloaded gradients, found-inf all-reduced over ``process_group``;
    its flags then 0-dim, as GradScaler's, for the packed step).

    Args:
        rule: The :class:`~autoscale.scalers.controller.ScaleRule` deciding the scale.
        device: As LossScaler's.
        process_group: The ranks the found-inf flag and the decision are agreed over (None: the
            world group), as ShardedGradScaler's argument of that name.
        **options: LossScaler's keyword arguments.
    """

    def __init__(
        self,
        rule: ScaleRule,
        device: str | None = None,
        *,
        process_group: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(rule, device, process_group=process_group, **options)
        self.process_group = process_group  # ShardedGradScaler's all-reduce group (None: world)


def as_sharded(scaler: LossScaler, process_group: Any = None) -> ShardedLossScaler:
    """``scaler``, now a :class:`ShardedLossScaler` (the same object, its rule and state kept).

    Raises:
        ConfigError: ``scaler`` is of a subclass of LossScaler, whose methods would be lost.
    """
    if isinstance(scaler, ShardedLossScaler):
        return scaler
    if type(scaler) is not LossScaler:
        raise ConfigError(
            f"as_sharded takes a LossScaler, got a {type(scaler).__name__}; build the scaler "
            "with autoscale.scalers.sharded.sharded_scaler(NAME) instead"
        )
    # every attribute either class reads is set: LossScaler's by its constructor, and
    # ShardedGradScaler's one (its group) here
    scaler.__class__ = ShardedLossScaler
    scaler.process_group = process_group
    return scaler


def sharded_scaler(
    name: str, device: str | None = None, *, process_group: Any = None, **overrides: Any
) -> ShardedLossScaler:
    """:func:`autoscale.scalers.make_scaler` (any rule or exported policy) as a
    :class:`ShardedLossScaler`, for FSDP1 where a program builds ``ShardedGradScaler``.

    Example::

        scaler = sharded_scaler("auto", "cuda")   # in place of ShardedGradScaler("cuda")
    """
    if overrides.get("identical_grads"):
        raise ConfigError(
            "identical_grads=True does not hold for sharded gradients (each rank holds its own "
            "shard); leave it out: the ranks agree on the found-inf flag"
        )
    scaler = make_scaler(name, device, process_group=process_group, **overrides)
    return as_sharded(scaler, process_group)
